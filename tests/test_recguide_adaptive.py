"""RecGuide adaptive drafting: hardware profiles, verifier signals, the value model fit, the decision rule, the rho
search, RecGuide's fitted tables and the launch scripts (profile, fit_tables, fit_delta)."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from recguide_jax.recguide import adaptive as ad
from recguide_jax.recguide.fit import overlap_fit as ovf
from recguide_jax.recguide import profile as pf
from recguide_jax.recguide.fit import rho_search as rs
from recguide_jax.recguide.fit import traces as tr
from recguide_jax.recguide.fit import value_fit as vf
from recguide_jax.recguide import signals as sig
from recguide_jax.recguide import value_model as vm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- synthetic shadow traces -----------------------------------------------------------------------------------------
def _q(s):
  """Ground-truth per-token continue probability: grows with s (low verifier entropy = easy text)."""
  return 0.55 + 0.4 / (1 + math.exp(-3 * (s + 1.5)))


def _true_value(b, s):
  q = _q(s)
  return sum(q ** (k - 1) for k in range(1, b + 1))  # E[min(L, B)] with P(L >= k) = q^(k-1)


def synthetic_rows(n_datasets=3, n_requests=40, n_rounds=20, seed=0):
  """Counterfactual lengths from one latent capacity L per round: A_B = min(L, B), so A8 <= A16 <= A32 like a real
  same-state shadow; z follows a fixed exploration of B with full = A_B == B."""
  rng = np.random.default_rng(seed)
  rows = []
  for d in range(n_datasets):
    for r in range(n_requests):
      prev = None
      for t in range(n_rounds):
        s = float(rng.uniform(-3.0, 0.0))
        q = _q(s)
        cap = int(rng.geometric(1 - q))  # P(cap >= k) = q^(k-1)
        a = {b: min(cap, b) for b in (8, 16, 32)}
        z = None if prev is None else sig.stratum_name(prev[0], prev[1])
        rows.append({"dataset": f"ds{d}", "request_id": f"r{r}", "round": t, "s": None if t == 0 else s, "z": z,
                     "A": {str(b): v for b, v in a.items()}})
        b_used = (8, 16, 32)[int(rng.integers(3))]
        prev = (b_used, a[b_used] == b_used)
  return rows


@pytest.fixture(scope="module")
def rows():
  return synthetic_rows()


@pytest.fixture(scope="module")
def model(rows):
  return vf.fit_value_model(rows, bins=8)


def _flat_model(values=(6, 9, 12), blocks=(8, 16, 32)):
  """A one-bin model whose V_B are exactly `values` (survival 1 for k <= V_B, else 0)."""
  survival = {b: np.array([[1.0 if k < v else 0.0 for k in range(b)]]) for b, v in zip(blocks, values)}
  uncond = {b: s[0] for b, s in survival.items()}
  return vm.ValueModel({"all": vm.SurvivalTable(np.zeros(0), survival, uncond)}, blocks, bins=1)


# ---- hardware profile ------------------------------------------------------------------------------------------------
def test_shipped_b200_profiles():
  assert set(pf.available_profiles()) >= {"b200_nld8b", "b200_nld14b"}
  p8, p14 = pf.load_profile("b200_nld8b"), pf.load_profile("b200_nld14b")
  assert p8.cost(1, 8) == 9.963
  assert p8.cost(128, 32) == 132.448 and p14.cost(128, 32) == 200.570 and p14.cost(2, 16) == 16.812
  assert p8.levels == (1, 2, 4, 8, 16, 32, 64, 128) and p8.block_sizes == (8, 16, 32)
  assert p8.device == "NVIDIA B200" and "7.6" in p8.source and "4.98" in p8.notes
  # no fused measurement: 4x query tokens per request at the same C, from the T(32)/T(8) ratio
  assert p8.fused_estimated and p8.ar_estimated
  assert p8.fused_cost(32, 8) == pytest.approx(p8.cost(32, 32) / 2)
  assert p8.fused_cost(1, 16) == pytest.approx(p8.cost(1, 16) / 2 * p8.cost(1, 32) / p8.cost(1, 8))
  assert p8.ar_cost(4) == pytest.approx(p8.cost(4, 8) / 2)


def test_shipped_h200_profile_is_measured():
  # launch/profile.py on an H200 (random NLD-8B weights): every field measured, nothing estimated
  p = pf.load_profile("h200_nld8b")
  assert p.device == "NVIDIA H200" and p.backend == "gpu" and "launch/profile.py" in p.source
  assert p.levels == (1, 4, 16, 64) and p.block_sizes == (8, 16, 32)
  assert not p.fused_estimated and not p.ar_estimated
  assert p.fused_cost(1, 16) < p.cost(1, 16)  # at C = 1 a fused tree costs about one verify, not draft + verify
  assert p.fused_cost(64, 32) > p.cost(64, 32)  # at C = 64 it costs more than a whole round


def test_profile_interpolation_and_clamping():
  p = pf.load_profile("b200_nld8b")
  assert p.cost(3, 8) == pytest.approx((10.955 + 16.572) / 2)
  assert p.cost(96, 16) == pytest.approx((43.548 + 76.842) / 2)
  assert p.cost(0.5, 8) == 9.963 and p.cost(1000, 32) == 132.448
  assert p.costs(16) == {8: 21.944, 16: 24.392, 32: 29.298}
  with pytest.raises(pf.ProfileError, match="block size 12"):
    p.cost(4, 12)
  with pytest.raises(pf.ProfileError, match="positive"):
    p.cost(0, 8)
  split = pf.HardwareProfile({1: {8: 10.0}, 4: {8: 20.0}}, draft_ms={1: {8: 4.0}, 4: {8: 8.0}},
                             verify_ms={1: {8: 6.0}, 4: {8: 12.0}}, ar_step_ms={1: 3.0, 4: 5.0},
                             fused_ms={1: {8: 7.0}, 4: {8: 9.0}})
  assert split.forward_costs(2, 8) == pytest.approx((4 + 4 / 3, 6 + 2))
  assert split.ar_cost(2.5) == pytest.approx(4.0) and split.fused_cost(4, 8) == 9.0 and not split.fused_estimated
  with pytest.raises(pf.ProfileError, match="needs blocks B and 4B"):
    pf.HardwareProfile({1: {8: 10.0, 16: 12.0}}).fused_cost(1, 8)


def test_profile_validation_and_round_trip(tmp_path):
  good = pf.load_profile("b200_nld14b").to_json()
  path = tmp_path / "p.json"
  pf.load_profile("b200_nld14b").save(path)
  assert pf.load_profile(path).to_json() == good

  def bad(patch, match):
    raw = json.loads(json.dumps(good))
    patch(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(pf.ProfileError, match=match):
      pf.load_profile(path)

  bad(lambda r: r.update(schema="recguide-profile/0"), "schema")
  bad(lambda r: r.pop("draft_verify_ms"), "draft_verify_ms")
  bad(lambda r: r["draft_verify_ms"]["4"].update({"16": -1}), r"draft_verify_ms\[4\]\[16\]")
  bad(lambda r: r["draft_verify_ms"]["4"].pop("32"), r"draft_verify_ms\[4\] has block sizes")
  bad(lambda r: r["draft_verify_ms"].update({"x": {"8": 1.0}}), "'x' is not a positive integer")
  bad(lambda r: r.update(ar_step_ms={"1": "fast"}), r"ar_step_ms\[1\]")
  bad(lambda r: r.update(speed=1), "unknown field 'speed'")
  bad(lambda r: r.update(draft_ms=r["draft_verify_ms"]), "draft_ms and verify_ms")
  with pytest.raises(pf.ProfileError, match="b200_nld8b"):
    pf.load_profile("no_such_profile")


# ---- signals ---------------------------------------------------------------------------------------------------------
def test_round_entropy_valid_positions():
  ent = np.arange(1.0, 9.0)  # B = 8, position i has entropy i+1
  assert sig.round_entropy(ent, 3, 8) == pytest.approx(2.0)  # m = 2: m+1 = 3 positions
  assert sig.round_entropy(ent, 1, 8) == pytest.approx(1.0)  # rejected at once: the first decision only
  assert sig.round_entropy(ent, 8, 8) == pytest.approx(4.0)  # full: B-1 positions, the bonus excluded
  assert sig.round_entropy(ent, 3, 8, eos=True) == pytest.approx(1.5)  # EOS: accept_len-1
  assert sig.round_entropy(ent, 1, 8, eos=True) is None
  assert sig.round_entropy(ent, 8, 8, head_cap=2) == pytest.approx(1.5)
  assert sig.round_entropy(ent, 5, 8, head_cap=7) == pytest.approx(3.0)
  assert sig.round_entropy([0.3], 1, 1) is None  # an AR step has no speculative decision
  with pytest.raises(ValueError, match="accepted"):
    sig.round_entropy(ent, 9, 8)


def test_round_entropies_equal_round_entropy_row_by_row():
  """The batched signal (a step's rows at once) is the per-row one to the last bit, whatever the rows' blocks,
  acceptance, EOS and head cap; it validates as the per-row one does."""
  rng = np.random.default_rng(0)
  for _ in range(50):
    rows = int(rng.integers(1, 40))
    ent = (rng.random((rows, 32)) * rng.choice([1.0, 10.0, 1e3])).astype(rng.choice([np.float32, np.float64]))
    blocks = rng.choice([1, 8, 16, 32], rows)
    accepted = np.array([rng.integers(1, b + 1) for b in blocks])
    eos = rng.random(rows) < 0.3
    cap = [None, 1, 7, 20][int(rng.integers(4))]
    want = [sig.round_entropy(ent[i], int(accepted[i]), int(blocks[i]), bool(eos[i]), cap) for i in range(rows)]
    got = sig.round_entropies(ent, accepted, blocks, eos, cap)
    assert got.dtype == np.float64 and [None if e != e else e for e in got.tolist()] == want  # NaN: None
  with pytest.raises(ValueError, match="accepted"):
    sig.round_entropies(np.ones((1, 8)), [9], [8], [False])


def test_signal_and_stratum():
  R = sig.RoundRecord
  assert sig.signal_s([]) is None and sig.stratum([]) is None
  assert sig.signal_s([R(8, 3, 1.0)]) == -1.0
  assert sig.signal_s([R(8, 3, 1.0), R(16, 16, 2.0), R(32, 5, 3.0)]) == -2.5
  assert sig.signal_s([R(8, 3, 1.0), R(16, 2, None)]) == -1.0
  assert sig.signal_s([R(8, 3, None)]) is None
  assert sig.stratum([R(16, 16, 0.1)]) == "b16_full" and sig.stratum([R(32, 31, 0.1)]) == "b32_partial"
  assert sig.stratum([R(1, 1, None)]) is None
  hist = [{"B": 8, "accepted": 8, "full": True, "e": 0.5}, {"B": 32, "accept_len": 4, "e": 1.5}]
  assert sig.signal_s(hist) == -1.0 and sig.stratum(hist) == "b32_partial"
  assert sig.STRATA == ("b8_partial", "b8_full", "b16_partial", "b16_full", "b32_partial", "b32_full")
  rec = sig.make_record(np.ones(16), 16, 16)
  assert rec.full and rec.entropy == 1.0


# ---- value model fit -------------------------------------------------------------------------------------------------
def test_weighted_pava_and_quantile_edges():
  assert vf.weighted_pava(np.array([1, 3, 2, 4.0]), np.ones(4)).tolist() == [1, 2.5, 2.5, 4]
  assert vf.weighted_pava(np.array([3, 1.0]), np.array([3, 1.0])).tolist() == [2.5, 2.5]
  assert vf.weighted_pava(np.array([1, 2, 3.0]), np.ones(3)).tolist() == [1, 2, 3]
  s = np.arange(100, dtype=float)
  w = np.where(s < 50, 3.0, 1.0)  # cumulative weight 3(i+1) below 50, then +1: quantiles 50/100/150 of 200
  assert vf.weighted_quantile_edges(s, w, 4).tolist() == [16, 33, 50]
  assert vf.weighted_quantile_edges(s, np.ones(100), 4).tolist() == [25, 50, 75]  # 25 values per bin
  ties = np.array([0.0] * 60 + [1.0] * 40)  # a cut at the minimum would leave an empty lowest bin
  assert vf.weighted_quantile_edges(ties, np.ones(100), 4).tolist() == [1.0]


def test_nested_weights():
  rows = ([{"dataset": "a", "request_id": "long", "round": t} for t in range(50)] +
          [{"dataset": "a", "request_id": "short", "round": t} for t in range(10)] +
          [{"dataset": "b", "request_id": f"r{i}", "round": 1} for i in range(20)])
  w = tr.nested_weights(rows)
  assert w.sum() == pytest.approx(1.0)
  assert w[0] == pytest.approx(0.5 * 0.5 / 50) and w[50] == pytest.approx(0.5 * 0.5 / 10)
  assert w[60] == pytest.approx(0.5 / 20)


def test_fit_uses_nested_weights():
  # row counts say 50/80 of the rounds are long, nested weights say 1/2 (per dataset) of 1/2 (per request)
  def row(d, r, t, a):
    return {"dataset": d, "request_id": r, "round": t, "s": None, "z": None, "A": {"8": a}}

  rows = ([row("a", "long", t, 8) for t in range(1, 51)] + [row("a", "short", t, 1) for t in range(1, 11)] +
          [row("b", f"r{i}", 1, 1) for i in range(20)])
  m = vf.fit_value_model(rows, bins=4)
  assert m.tables["all"].unconditional[8][1] == pytest.approx(0.25)
  assert m.value(8, None) == pytest.approx(1 + 7 * 0.25)


def test_fit_recovers_monotone_ground_truth(rows, model):
  assert model.block_sizes == (8, 16, 32) and model.bins == 8
  table = model.tables["all"]
  assert table.num_bins == 8 and len(table.edges) == 7
  for b in (8, 16, 32):
    sv = table.survival[b]
    assert sv.shape == (8, b)
    assert np.all(sv[:, 0] == 1.0)
    assert np.all(np.diff(sv, axis=0) >= 0)  # isotonic in s, for every k
    assert np.all(np.diff(sv, axis=1) <= 0)  # a survival function in k
    assert np.all(np.diff(table.unconditional[b]) <= 0)
  # each bin's V against the truth averaged over that bin's rows (same nested weights)
  train = [r for r in rows if r["round"] >= 1]
  w = tr.nested_weights(tr.validate_rows(train))
  s = np.array([r["s"] for r in train])
  bins = np.searchsorted(table.edges, s, side="right")
  for b in (8, 16, 32):
    truth = np.array([_true_value(b, x) for x in s])
    a = np.array([r["A"][str(b)] for r in train], float)
    for i in range(table.num_bins):
      sel = bins == i
      expect = np.sum(w[sel] * truth[sel]) / w[sel].sum()
      tol = 3 * a[sel].std() / math.sqrt(sel.sum()) + 0.05  # 3 standard errors of the bin's mean
      mid = float(np.median(s[sel]))
      assert model.value(b, mid) == pytest.approx(expect, abs=tol), (b, i)
  assert model.value(32, -0.1) > model.value(32, -2.9) + 3
  # undefined s: the unconditional row
  assert model.value(16, None) == pytest.approx(table.unconditional[16].sum())
  # the runtime lookup (a bisect over Python floats, one per request) is the fitted table's bin, exactly: edges
  # themselves, either side of them, outside the range, undefined
  probes = [float(e) + d for e in table.edges for d in (-1e-12, 0.0, 1e-12)] + [-1e9, 1e9, None, math.nan, math.inf]
  for x in probes:
    want = None if x is None or not math.isfinite(x) else int(np.searchsorted(table.edges, x, side="right"))
    assert table.bin_index(x) == want
    row = table.values(x)
    for b in (8, 16, 32):
      expect = table.unconditional[b].sum() if want is None else table.survival[b][want].sum()
      assert row[b] == table.value(b, x) == pytest.approx(expect, abs=1e-12)


def test_isotonic_repair_and_strata_fallback():
  def row(r, t, s, a, z):
    return {"dataset": "d", "request_id": f"r{r}", "round": t, "s": s, "z": z, "A": {"8": a}}

  # raw survival DEcreasing in s (low s always full, high s always rejected): isotonic regression pools them
  rows = [row(i, 1, -1.0, 8, "b8_full") for i in range(30)] + [row(30 + i, 1, 0.0, 1, "b16_partial")
                                                                 for i in range(30)]
  m = vf.fit_value_model(rows, bins=2)
  assert m.tables["all"].edges.tolist() == [0.0]
  assert m.tables["all"].survival[8][:, 7].tolist() == pytest.approx([0.5, 0.5])
  # strata: need max(48, 3*bins) rows; b8_full has 60, b16_partial 47 -> falls back to "all"
  rows = ([row(i, 1, -float(i % 7), 8, "b8_full") for i in range(60)] +
          [row(60 + i, 1, -float(i % 5), 2, "b16_partial") for i in range(47)])
  m = vf.fit_value_model(rows, bins=8)
  assert set(m.tables) == {"all", "b8_full"}
  assert m.value(8, -3.0, "b8_full") == 8.0
  assert m.value(8, -3.0, "b16_partial") == m.value(8, -3.0) == m.value(8, -3.0, None)
  assert set(vf.fit_value_model(rows, bins=8, strata=False).tables) == {"all"}
  # too few rows with s for binning: a single bin
  assert vf.fit_value_model(rows[:20], bins=8).tables["all"].num_bins == 1


def test_fit_only_uses_rounds_with_history_and_validates():
  rows = [{"dataset": "d", "request_id": "r", "round": 0, "s": None, "z": None, "A": {"8": 8}},
          {"dataset": "d", "request_id": "r", "round": 1, "s": -1.0, "z": "b8_full", "A": {"8": 1}}]
  m = vf.fit_value_model(rows, bins=2)
  assert m.value(8, None) == 1.0 and m.tables["all"].rows == 1
  with pytest.raises(vm.TraceError, match="history"):
    vf.fit_value_model(rows[:1])
  with pytest.raises(vm.TraceError, match=r"A\[8\]"):
    vf.fit_value_model([dict(rows[1], A={"8": 9})])
  with pytest.raises(vm.TraceError, match="'z'"):
    vf.fit_value_model([dict(rows[1], z="b12_full")])
  with pytest.raises(vm.TraceError, match="duplicate round"):
    vf.fit_value_model([rows[1], rows[1]])
  with pytest.raises(vm.TraceError, match="block sizes"):
    vf.fit_value_model([rows[1], dict(rows[1], round=2, A={"8": 3, "16": 3})])


def test_value_model_json_round_trip(model, tmp_path):
  model.save(tmp_path / "vm.json")
  back = vm.ValueModel.load(tmp_path / "vm.json")
  assert back.to_json() == model.to_json() and back.to_json()["schema"] == "recguide-value-model/1"
  for z in (None,) + sig.STRATA:
    for s in (None, -2.9, -1.5, -0.2, 5.0):
      assert back.values(s, z) == model.values(s, z)
  raw = model.to_json()
  raw["tables"]["all"]["edges"] = raw["tables"]["all"]["edges"][::-1]
  with pytest.raises(vm.TraceError, match="strictly increasing"):
    vm.ValueModel.from_json(raw)


def test_value_grid_holds_the_models_own_floats(model):
  """One gather from the value grid gives exactly what `values` and `values_capped` return, at every stratum, bin of
  s (and s undefined or not finite) and cap; `grid_rows` of many (s, z) equals `grid_row` of each."""
  grid = model.grid
  cases = [(s, z) for z in (None,) + sig.STRATA for s in (None, float("nan"), float("inf"), -9.0, 9.0,
                                                           *model.table(z).edges.tolist(),
                                                           *(model.table(z).edges + 1e-3).tolist())]
  rows = [model.grid_row(s, z) for s, z in cases]
  s = np.array([np.nan if x is None else x for x, _ in cases])
  strata = np.array([-1 if z is None else sig.STRATA.index(z) for _, z in cases])
  np.testing.assert_array_equal(model.grid_rows(s, strata), rows)
  for (x, z), row in zip(cases, rows):
    assert grid.values[row, :, grid.uncapped].tolist() == [model.values(x, z)[b] for b in model.block_sizes]
    for cap in range(grid.uncapped):
      want = model.values_capped(x, z, cap)
      assert grid.values[row, :, cap].tolist() == [want[b] for b in model.block_sizes], (x, z, cap)


def test_decide_grid_is_decide_at_every_row(model):
  for rho in (0.0, 0.05, 0.3, 1.5, 1e6):
    for costs in ({8: 10.0, 16: 12.0, 32: 16.0}, {16: 12.0, 32: 16.0}, {8: 1.0, 16: 1.0, 32: 1.0}):
      by_row = ad.decide_grid(model, rho, costs)
      for z in (None,) + sig.STRATA:
        for s in (None, -9.0, 9.0, *model.table(z).edges.tolist()):
          assert by_row[model.grid_row(s, z)] == ad.decide(model, rho, costs, s, z), (rho, costs, s, z)


# ---- decision rule ---------------------------------------------------------------------------------------------------
def test_decide_rule():
  m = _flat_model((6, 9, 12))
  costs = {8: 10.0, 16: 12.0, 32: 16.0}
  assert ad.decide(m, 0.0, costs, None, None) == 32  # rho = 0: the largest V
  assert ad.decide(m, 1e6, costs, -1.0, "b8_full") == 8  # huge rho: the cheapest block
  assert ad.decide(m, 0.5, costs, None, None) == 32  # U = 1, 3, 4
  # rho = 1.5: U8 = 6 - 15 = U16 = 9 - 18 = -9 > U32 = -12 -> the exact tie keeps the smaller B
  assert ad.decide(m, 1.5, costs, None, None) == 8
  assert ad.decide(_flat_model((6, 6, 6)), 0.0, {8: 1.0, 16: 1.0, 32: 1.0}, None, None) == 8
  assert ad.decide(m, 0.0, {16: 12.0, 32: 16.0}, None, None) == 32


def test_cold_start_table():
  for c, b in ((1, 32), (2, 32), (3, 32), (4, 32), (5, 32), (6, 16), (8, 16), (16, 16), (24, 16), (32, 16),
               (48, 8), (64, 8), (128, 8), (1000, 8)):
    assert ad.cold_start_block(c) == b, c
  with pytest.raises(ad.TablesError, match="positive"):
    ad.cold_start_block(0)


# ---- rho search ------------------------------------------------------------------------------------------------------
def _naive_objective(groups, model, costs, rho, cold):
  """Direct replay with `decide`, row by row: the definition the vectorised search must reproduce."""
  per_ds = []
  for reqs in groups.values():
    scores = []
    for rounds in reqs.values():
      tok = ms = 0.0
      for r in rounds:
        b = cold if r["round"] == 0 else ad.decide(model, rho, costs, r["s"], r["z"])
        tok += r["A"][b]
        ms += costs[b]
      scores.append(tok / ms)
    per_ds.append(sum(scores) / len(scores))
  return sum(per_ds) / len(per_ds)


def test_solve_rho_beats_a_fine_grid():
  rows = synthetic_rows(n_datasets=2, n_requests=8, n_rounds=12, seed=3)
  model = vf.fit_value_model(rows, bins=4)
  groups = rs.group_rows(rows)
  costs = pf.load_profile("b200_nld8b").costs(32)
  sol = rs.solve_rho(groups, model, costs, cold_start=16)
  assert sol.objective == pytest.approx(_naive_objective(groups, model, costs, sol.rho, 16), rel=1e-12)
  replay = rs._Replay(groups, model, costs, 16)
  top = float(replay.candidates().max())
  grid = np.concatenate([np.linspace(0, 1.5 * top, 500), [top * 10]])
  brute = [_naive_objective(groups, model, costs, float(r), 16) for r in grid]
  assert sol.objective >= max(brute) - 1e-12
  # ties go to the smaller rho: no smaller candidate reaches the optimum
  for c in replay.candidates():
    if c < sol.rho:
      assert replay.objective(float(c)) < sol.objective
  assert sum(sol.shares.values()) == pytest.approx(1.0)
  assert set(sol.fixed_objectives) == {8, 16, 32}
  assert sol.fixed_objectives[8] == pytest.approx(rs.fixed_objective(groups, costs, 8))


def test_solve_rho_follows_the_price():
  rows = synthetic_rows(n_datasets=2, n_requests=10, n_rounds=10, seed=5)
  model = vf.fit_value_model(rows, bins=4)
  groups = rs.group_rows(rows)
  cheap = {8: 10.0, 16: 10.1, 32: 10.2}  # long blocks almost free: B32 wherever its value exceeds B8's
  cheap_long = rs.solve_rho(groups, model, cheap)
  assert cheap_long.shares[32] > 0.4 and cheap_long.shares[32] > 2 * cheap_long.shares[8]
  assert cheap_long.objective >= rs.replay_objective(groups, model, cheap, 0.0)
  costly_long = rs.solve_rho(groups, model, {8: 10.0, 16: 40.0, 32: 160.0})
  assert costly_long.shares[8] == pytest.approx(1.0)
  assert costly_long.objective == pytest.approx(costly_long.fixed_objectives[8])


# ---- policy tables ---------------------------------------------------------------------------------------------------
def test_recguide_tables_round_trip_and_runtime(model, tmp_path):
  prof = pf.load_profile("b200_nld8b")
  levels = tuple(ad.LevelTable(c, rho, prof.costs(c), ad.cold_start_block(c), shares={8: 0.2, 16: 0.3, 32: 0.5})
                 for c, rho in ((2, 0.01), (16, 0.2), (128, 0.5)))
  tables = ad.RecGuideTables(model, levels, "b200_nld8b")
  assert len(tables.version) == 12 and tables.version == tables.content_hash()
  path = tables.save(tmp_path)  # a checkpoint directory gets recguide_tables.json
  assert path.name == ad.TABLES_FILENAME == "recguide_tables.json"
  back = ad.load_tables(tmp_path)
  assert back.to_json() == tables.to_json() and back.to_json()["schema"] == "recguide-tables/1"
  assert back.level(3).concurrency == 2 and back.level(6).concurrency == 16 and back.rho_for(1000) == 0.5
  # a load asked again gets the level it got (kept per load); a bool is no load, even after 1 was asked
  assert back.level(3) is back.level(3) and back.level(1).concurrency == 2
  with pytest.raises(ad.TablesError, match="positive"):
    back.level(True)
  assert back.costs_for(16) == prof.costs(16)
  assert back.next_block(16, []) == 16 and back.next_block(128, []) == 8
  hist = [sig.RoundRecord(16, 16, 0.2), sig.RoundRecord(32, 7, 1.1)]
  expect = ad.decide(model, 0.2, prof.costs(16), sig.signal_s(hist), "b32_partial")
  assert back.next_block(16, hist) == expect == back.decide(16, sig.signal_s(hist), "b32_partial")
  raw = tables.to_json()
  raw["levels"][1]["rho"] = -1
  with pytest.raises(ad.TablesError, match="rho"):
    ad.RecGuideTables.from_json(raw)
  raw = tables.to_json()
  raw["schema"] = "recguide-policy/9"
  with pytest.raises(ad.TablesError, match="schema"):
    ad.RecGuideTables.from_json(raw)
  with pytest.raises(ad.TablesError, match="does not exist"):
    ad.load_tables(tmp_path / "missing.json")


def test_policy_carries_the_fitted_overlap_delta(model, tmp_path):
  from recguide_jax.recguide.config import PAPER_DELTA
  from recguide_jax.recguide.controller import RecGuideStrategy
  levels = (ad.LevelTable(1, 0.1, pf.load_profile("b200_nld8b").costs(1), 32),)
  plain = ad.RecGuideTables(model, levels, "b200_nld8b")
  assert "overlap_delta" not in plain.to_json() and RecGuideStrategy(16, tables=plain).delta == PAPER_DELTA
  fitted = dataclasses.replace(plain, overlap_delta=0.15, version="")
  assert fitted.version != plain.version  # the threshold is part of the versioned content
  back = ad.load_tables(fitted.save(tmp_path / "p.json"))
  assert back.overlap_delta == 0.15 and RecGuideStrategy(16, tables=back).delta == 0.15
  assert RecGuideStrategy(16, tables=back, delta=0.4).delta == 0.4  # an explicit delta wins
  for bad in (1.5, "0.2", True):
    raw = fitted.to_json() | {"overlap_delta": bad}
    with pytest.raises(ad.TablesError, match="overlap_delta"):
      ad.RecGuideTables.from_json(raw)
  assert RecGuideStrategy(16, tables=back).planner == "no_p3"  # the paper's rule unless a planner was fitted
  planned = ad.load_tables(dataclasses.replace(back, overlap_planner="expected_hit", version="").save(tmp_path / "q"))
  assert planned.overlap_planner == "expected_hit" and RecGuideStrategy(16, tables=planned).planner == "expected_hit"
  for bad in ("greedy", 3):
    with pytest.raises(ad.TablesError, match="overlap_planner"):
      ad.RecGuideTables.from_json(fitted.to_json() | {"overlap_planner": bad})
  # the fitted tree width: versioned, used by the expected-hit planner only, the paper's 3 slots otherwise
  assert RecGuideStrategy(16, tables=planned).overlap_slots == 3 and "overlap_slots" not in planned.to_json()
  wide = ad.load_tables(dataclasses.replace(planned, overlap_slots=5, version="").save(tmp_path / "w"))
  assert wide.overlap_slots == 5 and wide.version != planned.version
  assert RecGuideStrategy(16, tables=wide).overlap_slots == 5
  assert "fused5" in RecGuideStrategy(16, tables=wide).step_kinds()
  assert RecGuideStrategy(16, tables=wide, planner="no_p3").overlap_slots == 3
  assert RecGuideStrategy(16, tables=wide, overlap_slots=4).overlap_slots == 4  # an explicit width wins
  for bad in (0, 9, "4", True, 2.0):
    with pytest.raises(ad.TablesError, match="overlap_slots"):
      ad.RecGuideTables.from_json(wide.to_json() | {"overlap_slots": bad})
  with pytest.raises(ValueError, match="no-P3"):
    RecGuideStrategy(16, planner="no_p3", overlap_slots=2)
  # the fitted prefix exponent: versioned, used by the expected-hit planner only, the plain product otherwise
  assert RecGuideStrategy(16, tables=wide).prefix_exponent == 1.0 and "overlap_prefix_exponent" not in wide.to_json()
  flat = ad.load_tables(dataclasses.replace(wide, overlap_prefix_exponent=0.35, version="").save(tmp_path / "g"))
  assert flat.overlap_prefix_exponent == 0.35 and flat.version != wide.version
  assert RecGuideStrategy(16, tables=flat).prefix_exponent == 0.35
  assert RecGuideStrategy(16, tables=flat, planner="no_p3").prefix_exponent == 1.0
  assert RecGuideStrategy(16, tables=flat, prefix_exponent=0.8).prefix_exponent == 0.8  # an explicit value wins
  for bad in (0, -0.5, 2.5, "0.3", True):
    with pytest.raises(ad.TablesError, match="overlap_prefix_exponent"):
      ad.RecGuideTables.from_json(flat.to_json() | {"overlap_prefix_exponent": bad})
  with pytest.raises(ValueError, match="prefix_exponent"):
    RecGuideStrategy(16, prefix_exponent=3.0)


def test_fused_cost_for_other_tree_widths():
  split = pf.HardwareProfile({1: {8: 10.0, 16: 12.0, 32: 16.0}}, draft_ms={1: {8: 5.0, 16: 6.0, 32: 8.0}},
                             verify_ms={1: {8: 5.0, 16: 6.0, 32: 8.0}}, fused_ms={1: {8: 8.0, 16: 12.0, 32: 20.0}})
  assert split.fused_cost(1, 16) == split.fused_cost(1, 16, 3) == 12.0
  # linear in the branch slots between the verify forward (0 slots) and the measured 3-slot tree
  assert split.fused_cost(1, 16, 6) == pytest.approx(6.0 + 6.0 * 6 / 3)
  assert split.fused_cost(1, 8, 1) == pytest.approx(5.0 + 3.0 / 3)
  with pytest.raises(pf.ProfileError, match="slot"):
    split.fused_cost(1, 8, 0)


# ---- out-of-fold validation -------------------------------------------------------------------------------------------
def test_out_of_fold_validation_keeps_requests_whole_and_tells_signal_from_noise():
  """Folds split requests, never a request's rounds; an informative s shows held-out skill and a rule that beats
  the best fixed B on held-out requests, an s of pure noise shows neither however finely it is binned."""
  from recguide_jax.recguide.fit import validation
  rows = synthetic_rows(n_datasets=2, n_requests=40, n_rounds=12, seed=3)
  assert len({validation.fold_of(r["dataset"], r["request_id"], 5) for r in rows}) == 5
  for r in rows:  # stable: a request's fold is a function of its name alone
    assert validation.fold_of(r["dataset"], r["request_id"], 5) == validation.fold_of(
        str(r["dataset"]), str(r["request_id"]), 5)
  levels = {c: (pf.load_profile("b200_nld8b").costs(c), ad.cold_start_block(c)) for c in (1, 32)}
  fit = lambda rs: vf.fit_value_model(rs, bins=8)  # noqa: E731
  informative = validation.cross_validate(rows, levels, folds=5, fit=fit)
  assert informative.folds == 5 and informative.requests == 80
  assert all(e.skill > 0.1 for e in informative.value_errors)
  assert all(abs(e.mean_predicted - e.mean_realized) < 0.15 * e.mean_realized for e in informative.value_errors)
  assert informative.levels[0].concurrency == 1 and informative.levels[0].gain > 1.0
  rng = np.random.default_rng(0)
  noise = [dict(r, s=None if r["s"] is None else float(rng.uniform(-3.0, 0.0))) for r in rows]
  fine = lambda rs: vf.fit_value_model(rs, bins=24, strata=False)  # noqa: E731
  held_out = validation.cross_validate(noise, levels, folds=5, fit=fine)
  assert all(e.skill < 0.01 for e in held_out.value_errors)
  assert all(lv.gain < 1.02 for lv in held_out.levels)  # nothing to adapt to: no gain over a fixed B
  json.dumps(held_out.to_json())
  with pytest.raises(ValueError, match="2 folds"):
    validation.cross_validate(rows, levels, folds=1)


# ---- launch scripts --------------------------------------------------------------------------------------------------
def _run(args, timeout):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  return proc.stdout


def test_fit_tables_end_to_end(tmp_path):
  rows = synthetic_rows(n_datasets=2, n_requests=12, n_rounds=10, seed=7)
  trace = tmp_path / "shadow.jsonl"
  trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "recguide_tables.json"
  stdout = _run(["launch/fit_tables.py", f"--traces={trace}", "--profile=b200_nld8b",
                 "--concurrency=1,16,128", "--bins=4", f"--output_dir={tmp_path}"], timeout=120)
  assert "C=16" in stdout and "best fixed B=" in stdout
  assert "out of fold (5 folds of 24 requests" in stdout and "skill" in stdout
  checked = json.loads((tmp_path / "recguide_tables_validation.json").read_text())
  assert [lv["concurrency"] for lv in checked["levels"]] == [1, 16, 128]
  tables = ad.load_tables(out)
  assert tables.concurrency_levels == (1, 16, 128) and tables.profile == "b200_nld8b"
  groups = rs.group_rows(rows)
  for lv in tables.levels:
    sol = rs.solve_rho(groups, tables.value_model, lv.costs_ms, cold_start=lv.cold_start_block)
    assert lv.rho == sol.rho and lv.objective == pytest.approx(sol.objective)
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(dict(rows[1], A={"8": 0, "16": 1, "32": 1})) + "\n")
  proc = subprocess.run([sys.executable, "launch/fit_tables.py", f"--traces={bad}", f"--output_dir={tmp_path}"],
                        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode != 0 and "bad.jsonl:1" in proc.stderr and "A[8]" in proc.stderr


def test_profile_script_random_tiny(tmp_path):
  out = tmp_path / "profile_cpu_tiny.json"
  # --concurrency: only the buckets asked for, every variant compiled before timing
  stdout = _run(["launch/profile.py", "--random_tiny", "--concurrency=1,2", "--block_sizes=8", "--repeats=1",
                 "--prefix_len=32", "--name=cpu_tiny", "--decode_steps=2", f"--output_dir={tmp_path}"], timeout=240)
  assert "wrote" in stdout and "(0 variants compiled after the warm-up)" in stdout  # the 2-step decode call too
  p = pf.load_profile(out)
  assert p.levels == (1, 2) and p.block_sizes == (8,) and p.name == "cpu_tiny" and p.backend == "cpu"
  assert p.cost(1, 8) > 0 and not p.ar_estimated and p.draft_ms is not None
  assert "ar_step_ms = one AR decode call of 2 step(s) divided by its steps" in p.notes  # priced as the engine runs
  assert p.cost(2, 8) == pytest.approx(p.forward_costs(2, 8)[0] + p.forward_costs(2, 8)[1], rel=0.5)
  from recguide_jax.runtime.runner import Runner
  if hasattr(Runner, "fused"):
    assert not p.fused_estimated and p.fused_cost(2, 8) > 0


def test_launch_profile_does_not_shadow_stdlib_profile():
  # launch scripts run with launch/ first on sys.path; cProfile (imported by flax via IPython) must still work
  code = ("import sys; sys.path.insert(0, 'launch'); import cProfile, profile; "
          "assert hasattr(profile, 'Profile') and 'launch' not in profile.__file__, profile.__file__; "
          "cProfile.run('1 + 1')")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_fit_delta_end_to_end(tmp_path):
  """launch/fit_delta.py on the bundled model: sweeps delta with overlap at C=1 (lossless checked inside) and writes
  the best one into a copy of the shipped tables."""
  import shutil
  from recguide_jax.llm import BUNDLED_CHECKPOINT
  policy = tmp_path / "tables.json"
  shutil.copy(os.path.join(BUNDLED_CHECKPOINT, ad.TABLES_FILENAME), policy)
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"question": q, "answer": "-"}) + "\n" for q in (
      "Ann has 5 apples and buys 7 more. How many apples does she have?",
      "A pen costs $3. How much do 4 pens cost?")))
  out = tmp_path / "fit_delta.json"
  stdout = _run(["launch/fit_delta.py", f"--data={data}", "--num_prompts=2", "--max_tokens=24",
                 "--deltas=0.1,0.4", "--slots=3,5", "--prefix_exponents=0.3", f"--recguide_tables={policy}",
                 f"--output_dir={tmp_path}"], timeout=300)
  sweep = json.loads(out.read_text())
  rows = sweep["sweep"]
  assert [(r["planner"], r["delta"], r["slots"]) for r in rows[:3]] == [
      ("no_p3", 0.1, 3), ("no_p3", 0.4, 3), ("expected_hit", None, 3)]
  # each width runs the plain product, replays gamma in {0.3, 1.0}, and runs the replay's best gamma if not 1
  plain = [r for r in rows if r["planner"] == "expected_hit" and r["prefix_exponent"] == 1.0]
  assert [r["slots"] for r in plain] == [3, 5]
  for r in plain:
    replayed = r["replayed_correction_hits"]
    assert set(replayed) == {"0.3", "1.0"}
    runs_flat = replayed["0.3"] > replayed["1.0"]
    assert any(x["slots"] == r["slots"] and x["prefix_exponent"] == 0.3 for x in rows) == runs_flat
  assert len(rows) == 2 + 2 + sum(r["replayed_correction_hits"]["0.3"] > r["replayed_correction_hits"]["1.0"]
                                  for r in plain)
  assert all(r["lossless"] and r["priced_tokens_per_ms"] > 0 for r in rows)
  fitted = ad.load_tables(policy)
  best = ovf.best_sweep_row(rows)
  assert sweep["best_delta"] == ovf.best_sweep_row(rows[:2])["delta"] == fitted.overlap_delta
  assert sweep["best_planner"] == best["planner"] == fitted.overlap_planner
  assert fitted.overlap_slots == (best["slots"] if best["planner"] == "expected_hit" else None)
  assert fitted.overlap_prefix_exponent == best["prefix_exponent"] == sweep["best_prefix_exponent"]
  assert "best:" in stdout


def test_bench_recguide_end_to_end(tmp_path):
  """launch/bench_recguide.py on the bundled model at two loads with interleaved repeats: every row is lossless,
  the priced and wall-clock ratios are filled in, and the ablation rows of Tables 5 and 6 are present."""
  data = tmp_path / "test.jsonl"
  data.write_text("".join(json.dumps({"question": q, "answer": "-"}) + "\n" for q in (
      "Ann has 5 apples and buys 7 more. How many apples does she have?",
      "A pen costs $3. How much do 4 pens cost?", "Tom walks 3 miles a day. How far does he walk in a week?")))
  out_json, out_md = tmp_path / "bench_recguide.json", tmp_path / "bench_recguide.md"
  _run(["launch/bench_recguide.py", f"--data={data}", "--num_prompts=3", "--max_tokens=20", "--concurrency=1,2",
        "--repeats=2", "--profile=docs/profile_cpu.json", f"--output_dir={tmp_path}"],
       timeout=600)
  res = json.loads(out_json.read_text())
  rows = {(r["policy"], r["concurrency"]): r for r in res["results"]}
  assert all(r["lossless"] for r in res["results"])
  assert {"overlap +1st corr", "overlap +2nd corr", "overlap +continuation", "overlap expected-hit planner"} <= {
      p for p, c in rows if c == 1}
  assert {"adaptive no bucketing", "adaptive + bucketing", "adaptive + cost-aware grouping"} <= {
      p for p, c in rows if c == 2}
  wall_rows = ("ar", "linear B=8", "linear B=16", "linear B=32", "recguide")
  for r in res["results"]:  # wall-clock rows repeat; priced rows (deterministic greedy runs) run once
    assert len(r["wall_s_all"]) == (2 if r["policy"] in wall_rows else 1)
    assert r["vs_best_baseline_wall"] > 0 and r["priced_tokens_per_ms"] > 0
    paired = r.get("vs_best_baseline_wall_paired")
    assert (paired is not None) == (r["policy"] in wall_rows)
    if paired:  # per repeat against that repeat's fastest baseline: a baseline never beats itself
      assert len(paired["all"]) == 2 and paired["min"] <= paired["median"] <= paired["max"]
      assert r["policy"] == "recguide" or paired["max"] <= 1.0 + 1e-9
      iv = r["vs_best_baseline_wall_interval"]  # against the fastest baseline by median, with its interval
      assert iv["baseline"] in wall_rows[:4] and iv["repeats"] == 2 and iv["verdict"] in ("ahead", "tie", "behind")
      assert iv["ci95"][0] <= iv["geomean"] <= iv["ci95"][1]
      if iv["baseline"] == r["policy"]:
        assert iv["geomean"] == pytest.approx(1.0) and iv["verdict"] == "tie"
  pooled = res["recguide_vs_best_baseline_wall_pooled"]  # over both levels, 2 repeats each
  assert pooled["repeats"] == 4 and pooled["ci95"][0] <= pooled["geomean"] <= pooled["ci95"][1]
  assert res["meta"]["compiles_after_warmup"] == 0
  md = out_md.read_text()
  assert res["meta"]["delta"] > 0 and "| recguide |" in md and "pooled over 2 levels" in md
