"""Prices of what RecGuide plans, as the engine will run it (issue 36): a step's plan on ragged steps, the draft
forward an overlap step skips only when no request needs it, and the fitted rho_C rule carried to another profile.

Pure functions of a profile (or cost callables), so the controller, the benchmarks and the tests price alike.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np


def ragged_step_cost(blocks: Sequence[int], profile) -> float:
  """Profile ms of one engine step whose rows are planned at `blocks` (1: an AR row) on ragged steps: one draft
  forward of the LinearSS rows (their blocks packed) when there is one, and one verify forward of every row
  (`HardwareProfile.ragged_cost`). Rows keep their own blocks: no bucket split, no padding to the largest. A step
  of AR rows only is an AR decode forward."""
  blocks = [int(b) for b in blocks]
  if not blocks:
    return 0.0
  drafting = [b for b in blocks if b > 1]
  if not drafting:
    return profile.ar_cost(len(blocks))
  return (profile.ragged_cost(len(drafting), sum(drafting), draft=True)
          + profile.ragged_cost(len(blocks), sum(blocks), draft=False))


def drafting_rows_distribution(shares: Sequence[float]) -> np.ndarray:
  """P(K = k) for k = 0..n, K the number of rows that draft when row i drafts with probability shares[i]
  independently (Poisson-binomial, by convolution)."""
  dist = np.zeros(len(shares) + 1)
  dist[0] = 1.0
  for i, s in enumerate(shares):
    s = min(max(float(s), 0.0), 1.0)
    dist[1:i + 2] = dist[1:i + 2] * (1.0 - s) + dist[:i + 1] * s
    dist[0] *= 1.0 - s
  return dist


def expected_draft_cost(shares: Sequence[float], draft_cost: Callable[[int], float]) -> float:
  """E[cost of an overlap step's draft forward] when row i needs a draft with probability shares[i] (1 - h_i, h_i
  its chance of holding a reusable branch): the forward runs for the K rows that need it, at draft_cost(K), and is
  skipped only when K = 0, with probability prod_i h_i. Pricing the forward by the mean share instead (share x the
  full forward) charges a batch as if its rows skipped their drafts one by one, which a batched forward does not."""
  dist = drafting_rows_distribution(shares)
  return float(sum(p * draft_cost(k) for k, p in enumerate(dist) if k > 0 and p > 0.0))


def rescaled_rho(rho: float, fitted_costs: Mapping[int, float], costs: Mapping[int, float]) -> float:
  """The fitted rule argmax_B V_B - rho T(B) carried to costs in another profile's time unit: rho times the ratio
  of the fitted level's costs to these costs over the blocks both price (their sums), so the rule keeps its form
  (a price per unit time) on any profile instead of becoming argmax V_B / T(B). On the fitted costs it is rho."""
  common = [b for b in fitted_costs if b in costs]
  if not common:
    raise ValueError(f"no block priced by both the fitted costs {sorted(fitted_costs)} and {sorted(costs)}")
  return float(rho) * sum(fitted_costs[b] for b in common) / sum(costs[b] for b in common)


def decide_rescaled(values: Mapping[int, float], rho: float, fitted_costs: Mapping[int, float],
                    costs: Mapping[int, float]) -> int:
  """argmax_B V_B - rho' T(B) over the blocks of `costs`, rho' = `rescaled_rho` (B ascending, a strict ">" keeps
  the smaller block on ties, as `adaptive.decide`)."""
  r = rescaled_rho(rho, fitted_costs, costs)
  best, best_u = None, -np.inf
  for b in sorted(costs):
    u = values[b] - r * costs[b]
    if u > best_u:
      best, best_u = b, u
  return best
