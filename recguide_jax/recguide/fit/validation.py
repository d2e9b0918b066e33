"""Out-of-fold validation of RecGuide's fitted tables (issue 36): how well the value model and the rho_C rule carry to
requests they were not fitted on.

Requests (never single rounds: a request's rounds share its text and are not independent) are split into K folds
by a stable hash of (dataset, request id). For each fold the value model and rho_C are fitted on the other folds, as
`launch/fit_tables.py` fits them on everything, and scored on the held-out fold:
- the value model: per B, the weighted mean absolute error of V_B(s, z) against the A_B the round would have
  accepted, beside the training folds' unconditional mean (a model without the signal); skill = 1 - MAE / that;
- the rule: the replay objective of `rho_search` (macro tokens per ms per request) at the training folds' rho,
  against the fixed B that was best on the training folds, on the same held-out requests.
An in-sample gain that the held-out folds do not keep is a fit to the traces, not to the model's behaviour.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Mapping, Sequence

import numpy as np

from recguide_jax.recguide.fit import rho_search, traces, value_fit
from recguide_jax.recguide.value_model import TraceError


@dataclasses.dataclass(frozen=True)
class BlockError:
  """The value model's held-out error for one block size (weighted over rounds with history)."""
  block_size: int
  mae: float  # mean |V_B(s, z) - A_B|
  baseline_mae: float  # the same with the training folds' unconditional mean V_B
  mean_predicted: float
  mean_realized: float

  @property
  def skill(self) -> float:
    return 1.0 - self.mae / self.baseline_mae if self.baseline_mae > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class LevelValidation:
  """The rule at one load level, fold by fold on held-out requests (means over the folds)."""
  concurrency: int
  rule: float  # objective at the training folds' rho
  best_fixed: float  # objective of the training folds' best fixed B
  fold_gains: tuple[float, ...]  # rule / best fixed, per fold

  @property
  def gain(self) -> float:
    return self.rule / self.best_fixed if self.best_fixed > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class Validation:
  folds: int
  requests: int
  value_errors: tuple[BlockError, ...]
  levels: tuple[LevelValidation, ...]

  def to_json(self) -> dict:
    return {"folds": self.folds, "requests": self.requests,
            "value_model": [{**dataclasses.asdict(e), "skill": e.skill} for e in self.value_errors],
            "levels": [{**dataclasses.asdict(lv), "fold_gains": list(lv.fold_gains), "gain": lv.gain}
                       for lv in self.levels]}


def fold_of(dataset: str, request_id: str, folds: int) -> int:
  """A request's fold: a stable hash of its dataset and id (the same split on every machine and run)."""
  digest = hashlib.sha256(f"{dataset}\0{request_id}".encode()).digest()
  return int.from_bytes(digest[:8], "little") % folds


def cross_validate(rows: Sequence[Mapping], levels: Mapping[int, tuple[Mapping[int, float], int]], folds: int = 5,
                   fit: Callable[[Sequence[Mapping]], object] | None = None) -> Validation:
  """K-fold validation of the tables `launch/fit_tables.py` fits from `rows`. `levels`: {C: (T_C(B) costs, cold
  start B)}; `fit(rows)`: the value model fit (default `value_fit.fit_value_model` with its defaults)."""
  if folds < 2:
    raise ValueError(f"cross-validation needs at least 2 folds, got {folds}")
  rows = traces.validate_rows(rows)
  fit = fit or value_fit.fit_value_model
  fold = np.array([fold_of(r["dataset"], r["request_id"], folds) for r in rows])
  requests = len({(r["dataset"], r["request_id"]) for r in rows})
  used = sorted(set(fold.tolist()))
  if len(used) < 2:
    raise TraceError(f"{requests} request(s) fill fewer than 2 of {folds} folds: too few to cross-validate")
  blocks = tuple(rows[0]["A"])
  errors = {b: [] for b in blocks}  # per fold: (weights, predicted, baseline, realized)
  per_level: dict[int, list[tuple[float, float]]] = {c: [] for c in levels}
  for k in used:
    train = [r for r, f in zip(rows, fold) if f != k]
    held = [r for r, f in zip(rows, fold) if f == k]
    model = fit(train)
    scored = [r for r in held if r["round"] >= 1]  # rounds with history: what the model was fitted on
    if scored:
      w = traces.nested_weights(scored)
      for b in blocks:
        realized = np.array([r["A"][b] for r in scored], np.float64)
        predicted = np.array([model.value(b, r["s"], r["z"]) for r in scored], np.float64)
        baseline = np.full(len(scored), model.value(b, None, None))
        errors[b].append((w, predicted, baseline, realized))
    train_groups, held_groups = rho_search.group_rows(train), rho_search.group_rows(held)
    for c, (costs, cold) in levels.items():
      sol = rho_search.solve_rho(train_groups, model, costs, cold_start=cold)
      rule = rho_search.replay_objective(held_groups, model, costs, sol.rho, cold_start=cold)
      fixed = rho_search.fixed_objective(held_groups, costs, sol.best_fixed_block)
      per_level[c].append((rule, fixed))
  value_errors = []
  for b in blocks:
    if not errors[b]:
      continue
    w, pred, base, real = (np.concatenate(x) for x in zip(*errors[b]))
    w = w / w.sum()
    value_errors.append(BlockError(b, float(w @ np.abs(pred - real)), float(w @ np.abs(base - real)),
                                    float(w @ pred), float(w @ real)))
  out_levels = tuple(LevelValidation(c, float(np.mean([r for r, _ in scores])), float(np.mean([f for _, f in scores])),
                                     tuple(r / f if f > 0 else float("nan") for r, f in scores))
                     for c, scores in per_level.items())
  return Validation(len(used), requests, tuple(value_errors), out_levels)
