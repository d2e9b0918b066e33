"""Fitting RecGuide's overlap planner offline (launch/fit_delta.py): logged overlap rounds (`OverlapTrace`, what
the strategy records in `overlap_log`) replayed under another planner setting, the prefix-exponent search, and the
choice among sweep rows."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from recguide_jax.recguide.overlap import CORRECTION, plan_expected_hit


@dataclasses.dataclass(frozen=True)
class OverlapTrace:
  """One request's overlap round as RecGuide logs it (`RecGuideStrategy.overlap_log`): the draft's signals, the
  planner's bounds at planning time and what verification then decided. Enough to replay any planner's correction
  hits."""
  signals: np.ndarray  # [3, B] confidence, margin, runner-up
  accepted: int  # 1..B
  seed: int  # the verifier's token at the first rejected position (the bonus on full acceptance)
  generated: int
  committed: int
  max_new: int
  max_len: int


def replay_correction_hits(rounds: Sequence[OverlapTrace], block: int, slots: int, prefix_exponent: float) -> float:
  """Share of logged rounds in which the expected-hit plan with this exponent would have had a correction hit.
  Continuation hits are not replayed (whether a continuation guessed the bonus is known only where one ran); they
  were under 1% of rounds on the bundled model."""
  if not rounds:
    raise ValueError("no overlap rounds to replay")
  hits = 0
  for r in rounds:
    plan = plan_expected_hit(r.signals, block, generated=r.generated, committed=r.committed, max_new=r.max_new,
                             max_len=r.max_len, max_branches=slots, prefix_exponent=prefix_exponent)
    hits += any(b.kind == CORRECTION and b.pre == r.accepted and b.alt == r.seed for b in plan)
  return hits / len(rounds)


def fit_prefix_exponent(rounds: Sequence[OverlapTrace], block: int, slots: int,
                        grid: Sequence[float] = tuple(np.round(np.arange(0.1, 1.0001, 0.05), 2))
                        ) -> tuple[float, dict[float, float]]:
  """The exponent of `grid` with the most replayed correction hits (ties to the larger one, the plain product at
  1.0 on a tie with it); returns (gamma, {gamma: hit rate})."""
  rates = {float(g): replay_correction_hits(rounds, block, slots, float(g)) for g in grid}
  best = max(rates, key=lambda g: (round(rates[g], 6), g))
  return best, rates


def best_sweep_row(rows: Sequence[dict], rel_tol: float = 1e-3) -> dict:
  """The overlap configuration a fit keeps from sweep rows (each with "priced_tokens_per_ms", "tpf", "slots",
  "delta", "prefix_exponent"): the most tokens per priced ms; among rows within `rel_tol` of the best price, the
  most tokens per forward. Why TPF breaks price ties: the price counts device time only, and every forward also
  costs host time (dispatch, synchronisation, scheduling) that a profile does not see; and a width the profile did
  not measure is priced linearly in its slots, an upper bound on a memory-bound device. Then the narrower tree,
  the larger delta, the exponent nearer 1."""
  if not rows:
    raise ValueError("no sweep rows to choose from")
  top = max(r["priced_tokens_per_ms"] for r in rows)
  near = [r for r in rows if r["priced_tokens_per_ms"] >= top * (1.0 - rel_tol)]
  return max(near, key=lambda r: (r["tpf"], -r["slots"], r["delta"] or 0.0, r["prefix_exponent"] or 0.0))
