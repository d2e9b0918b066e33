"""Prices of what RecGuide plans, as the engine will run it (issue 36): a step's plan on ragged steps, the draft
forward an overlap step skips only when no request needs it, and the fitted rho_C rule carried to another profile.

Pure functions of a profile (or of costs), so the controller, the benchmarks and the tests price alike.
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np


def ragged_step_cost(blocks: Sequence[int], profile) -> float:
  """Profile ms of one engine step whose rows are planned at `blocks` (1: an AR row) on ragged steps: one draft
  forward of the LinearSS rows (their blocks packed) when there is one, and one verify forward of every row
  (`HardwareProfile.ragged_cost`). Rows keep their own blocks: no bucket split, no padding to the largest. A step
  of AR rows only is an AR decode forward."""
  return ragged_counts_cost(collections.Counter(int(b) for b in blocks), profile)


def ragged_counts_cost(counts: Mapping[int, int], profile) -> float:
  """`ragged_step_cost` of a step planned as `counts` (rows per block)."""
  rows = sum(counts.values())
  if not rows:
    return 0.0
  drafting = sum(n for b, n in counts.items() if b > 1)
  if not drafting:
    return profile.ar_cost(rows)
  drafted = sum(b * n for b, n in counts.items() if b > 1)
  return (profile.ragged_cost(drafting, drafted, draft=True)
          + profile.ragged_cost(rows, sum(b * n for b, n in counts.items()), draft=False))


def verify_token_price(blocks: Sequence[int], tokens: float, profile) -> float:
  """What one more verified draft token must be expected to return (in tokens) for a step planned at `blocks` on
  ragged steps that expects `tokens`: the step's planned rate (tokens per profile ms) times what the last query
  token of its verify forward costs (`HardwareProfile.ragged_cost` at one token fewer). A ratio of two costs, so
  any uniform rescaling of the profile (a wall-clock calibration) leaves it as it is. 0 where a shorter verify
  costs the same (below the profile's smallest block per row without a measured AR step: weight-bound)."""
  blocks = [int(b) for b in blocks]
  n = sum(blocks)
  if not any(b > 1 for b in blocks) or tokens <= 0:
    return 0.0
  c = len(blocks)
  saved = profile.ragged_cost(c, n, draft=False) - profile.ragged_cost(c, n - 1, draft=False)
  return max(0.0, float(tokens) / ragged_step_cost(blocks, profile) * saved)


def rescaled_rho(rho: float, fitted_costs: Mapping[int, float], costs: Mapping[int, float]) -> float:
  """The fitted rule argmax_B V_B - rho T(B) carried to costs in another profile's time unit: rho times the ratio
  of the fitted level's costs to these costs over the blocks both price (their sums), so the rule keeps its form
  (a price per unit time) on any profile instead of becoming argmax V_B / T(B). On the fitted costs it is rho."""
  common = [b for b in fitted_costs if b in costs]
  if not common:
    raise ValueError(f"no block priced by both the fitted costs {sorted(fitted_costs)} and {sorted(costs)}")
  return float(rho) * sum(fitted_costs[b] for b in common) / sum(costs[b] for b in common)


def decide_rescaled_rows(values: np.ndarray, rho: float, fitted_costs: Mapping[int, float],
                         costs: Mapping[int, float]) -> np.ndarray:
  """`decide_rescaled` of each row of `values` ([requests, blocks], a column per block of `costs`, ascending)."""
  blocks = sorted(costs)
  score = values - rescaled_rho(rho, fitted_costs, costs) * np.array([costs[b] for b in blocks], np.float64)
  return np.asarray(blocks)[np.argmax(score, axis=1)]  # the first of equal scores: the smaller block


def decide_rescaled(values: Mapping[int, float], rho: float, fitted_costs: Mapping[int, float],
                    costs: Mapping[int, float]) -> int:
  """argmax_B V_B - rho' T(B) over the blocks of `costs`, rho' = `rescaled_rho` (B ascending, the smaller block on
  ties, as `adaptive.decide`)."""
  row = np.array([[values[b] for b in sorted(costs)]], np.float64)
  return int(decide_rescaled_rows(row, rho, fitted_costs, costs)[0])
