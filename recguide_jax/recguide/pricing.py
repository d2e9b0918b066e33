"""Prices of what RecGuide plans, as the engine will run it (issue 36): a step's plan on ragged steps, the draft
forward an overlap step skips only when no request needs it, and the fitted rho_C rule carried to another profile.

Pure functions of a profile (or of costs), so the controller, the benchmarks and the tests price alike.
"""

from __future__ import annotations

from typing import Mapping, Sequence

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


def drafting_rows_distribution(shares: Sequence[float]) -> np.ndarray:
  """P(K = k) for k = 0..n, K the number of rows that draft when row i drafts with probability shares[i]
  independently (Poisson-binomial). From its characteristic function at the n + 1 roots of unity, inverted by one
  DFT (Hong 2013, "DFT-CF"): O(n^2) in a few array operations, where a convolution row by row is n Python steps
  per engine step; absolute error ~1e-15."""
  s = np.clip(np.asarray(shares, np.float64), 0.0, 1.0)
  n = len(s)
  # E[w^K] = prod_i (1 - s_i + s_i w) at w = exp(-2 pi i l / (n + 1)): the DFT of P(K = k), whose second half is the
  # first's conjugate (P is real)
  w = np.exp(-2j * np.pi * np.arange((n + 1) // 2 + 1) / (n + 1))
  terms = np.multiply.outer(s, w - 1.0)
  terms += 1.0
  return np.clip(np.fft.irfft(np.prod(terms, axis=0), n + 1), 0.0, 1.0)


def expected_draft_cost(shares: Sequence[float], cost_by_rows: np.ndarray,
                        affine: tuple[float, float] | None = None) -> float:
  """E[cost of an overlap step's draft forward] when row i needs a draft with probability shares[i] (1 - h_i, h_i
  its chance of holding a reusable branch): the forward runs for the K rows that need it, at cost_by_rows[K]
  (k = 0..len(shares); entry 0 unused), and is skipped only when K = 0, with probability prod_i h_i. Pricing the
  forward by the mean share instead (share x the full forward) charges a batch as if its rows skipped their drafts
  one by one, which a batched forward does not. `affine`: `affine_costs(cost_by_rows)` where known (a cost a + b k
  needs only P(K >= 1) and E[K], not K's distribution)."""
  if affine is not None:
    a, b = affine
    s = np.clip(np.asarray(shares, np.float64), 0.0, 1.0)
    return float(a * (1.0 - np.prod(1.0 - s)) + b * s.sum())
  dist = drafting_rows_distribution(shares)
  return float(dist[1:] @ np.asarray(cost_by_rows, np.float64)[1:len(dist)])


def affine_costs(cost_by_rows: np.ndarray, rtol: float = 1e-9) -> tuple[float, float] | None:
  """(a, b) with cost_by_rows[k] = a + b k for every k >= 1 (a forward whose cost does not grow with its rows, or
  grows by the same amount per row), else None."""
  c = np.asarray(cost_by_rows, np.float64)[1:]
  if not len(c):
    return None
  b = float(c[1] - c[0]) if len(c) > 1 else 0.0
  a = float(c[0]) - b
  fit = a + b * np.arange(1, len(c) + 1)
  return (a, b) if np.allclose(fit, c, rtol=rtol, atol=0.0) else None


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
