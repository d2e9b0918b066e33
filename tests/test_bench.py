"""Benchmark helpers: pricing a forward ledger with a profile, and the paired tau comparison of the model card."""

import numpy as np
import pytest

from recguide_jax import bench
from recguide_jax.orchestrator.profile import HardwareProfile


def test_priced_ms_charges_each_forward_by_kind_and_batch():
  prof = HardwareProfile({1: {8: 10.0, 16: 12.0}, 4: {8: 20.0, 16: 24.0}}, draft_ms={1: {8: 4.0, 16: 5.0},
                                                                                     4: {8: 8.0, 16: 10.0}},
                         verify_ms={1: {8: 6.0, 16: 7.0}, 4: {8: 12.0, 16: 14.0}}, ar_step_ms={1: 2.0, 4: 3.0},
                         fused_ms={1: {8: 9.0, 16: 13.0}, 4: {8: 18.0, 16: 26.0}})
  log = [("prefill", 64, 1), ("draft", 8, 1), ("verify", 8, 4), ("gverify", 16, 1), ("decode", 1, 4),
         ("fused", 16, 1), ("fused5", 16, 1)]
  want = 4.0 + 12.0 + 7.0 + 3.0 + 13.0 + (7.0 + (13.0 - 7.0) * 5 / 3)  # prefill is not decode time
  assert bench.priced_ms(log, prof) == pytest.approx(want)
  assert bench.priced_ms([("draft", 8, 2)], prof) == pytest.approx(4.0 + 4.0 / 3)  # interpolated in C


def test_paired_tau_gain_is_pooled_and_bootstrapped_over_prompts():
  rng = np.random.default_rng(0)
  small = [(int(n) * 4, int(n)) for n in rng.integers(5, 30, 50)]  # tau 4 on every prompt
  large = [(a + r // 2, r) for a, r in small]  # +0.5 per round on every prompt
  gain = bench.paired_tau_gain({8: small, 32: large}, 8, 32)
  assert gain["prompts"] == 50
  assert gain["diff"] == pytest.approx(sum(a for a, _ in large) / sum(r for _, r in large) - 4.0)
  assert gain["ci95"][0] <= gain["diff"] <= gain["ci95"][1] and gain["ci95"][0] > 0.4
  same = bench.paired_tau_gain({8: small, 32: small}, 8, 32)
  assert same["diff"] == 0.0 and same["ci95"] == [0.0, 0.0]
  noisy = [(a + int(rng.integers(-3 * r, 3 * r)), r) for a, r in small]  # no real gain: the interval covers 0
  wide = bench.paired_tau_gain({8: small, 32: noisy}, 8, 32)
  assert wide["ci95"][0] < 0 < wide["ci95"][1]


def test_paired_ratio_interval_separates_a_real_gap_from_noise():
  rng = np.random.default_rng(1)
  base = 3.0 * np.exp(rng.normal(0, 0.15, 9))  # a drifting machine: +-15% from repeat to repeat
  faster = bench.paired_ratio_interval(base / 1.1 * np.exp(rng.normal(0, 0.01, 9)), base)  # 10% faster, paired
  assert faster["verdict"] == "ahead" and faster["ci95"][0] > 1.05 and faster["repeats"] == 9
  assert faster["ci95"][0] <= faster["geomean"] <= faster["ci95"][1]
  slower = bench.paired_ratio_interval(base * 1.1, base)
  assert slower["verdict"] == "behind" and slower["geomean"] == pytest.approx(1 / 1.1)
  noise = bench.paired_ratio_interval(3.0 * np.exp(rng.normal(0, 0.15, 9)), base)  # same work, unpaired noise
  assert noise["verdict"] == "tie" and noise["ci95"][0] < 1 < noise["ci95"][1]
  with pytest.raises(ValueError, match="one baseline wall time per repeat"):
    bench.paired_ratio_interval([1.0, 2.0], [1.0])
  # pooled over levels: small per-level gaps that no single level resolves add up; each level weighs the same
  walls = [3.0 * np.exp(rng.normal(0, 0.05, 9)) for _ in range(6)]
  levels = [(w * 1.03, w * np.exp(rng.normal(0, 0.03, 9))) for w in walls]  # 3% slower everywhere, 3% noise
  per_level = [bench.paired_ratio_interval(t, b) for t, b in levels]
  pooled = bench.pooled_ratio_interval(levels)
  assert pooled["verdict"] == "behind" and pooled["repeats"] == 54
  assert pooled["geomean"] == pytest.approx(np.exp(np.mean([np.log(p["geomean"]) for p in per_level])))
  assert pooled["ci95"][1] - pooled["ci95"][0] < min(p["ci95"][1] - p["ci95"][0] for p in per_level)
  assert bench.pooled_ratio_interval([([2.0, 3.0], [2.0, 3.0])])["verdict"] == "tie"
  with pytest.raises(ValueError):
    bench.pooled_ratio_interval([])


def test_paired_wall_ratios_pair_each_repeat_with_its_best_baseline():
  ratios = bench.paired_wall_ratios([2.0, 4.0, 3.0], {"ar": [2.2, 4.0, 3.3], "linear B=8": [1.9, 5.0, 3.6]})
  assert ratios == pytest.approx([1.9 / 2.0, 4.0 / 4.0, 3.3 / 3.0])
  with pytest.raises(ValueError, match="one wall time per repeat"):
    bench.paired_wall_ratios([2.0, 4.0], {"ar": [2.0]})
  with pytest.raises(ValueError):
    bench.paired_wall_ratios([2.0], {})
