"""The offline search for RecGuide's price rho_C (docs/spec/recguide.md §5.4): shadow-trace rounds replayed with the
block the adaptive rule (`adaptive.decide`) would choose at a price, and the exact 1-D search over the prices at
which a choice changes for the one with the most tokens per unit time (macro-averaged over datasets)."""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Mapping, Sequence

import numpy as np

from recguide_jax.recguide import value_model as vm
from recguide_jax.recguide.fit import traces
from recguide_jax.recguide.adaptive import LINSPACE_POINTS, TablesError


def group_rows(rows: Sequence[Mapping]) -> dict[str, dict[str, list[dict]]]:
  """{dataset: {request_id: [rows sorted by round]}} after validating the rows."""
  out: dict[str, dict[str, list[dict]]] = {}
  for r in traces.validate_rows(rows):
    out.setdefault(r["dataset"], {}).setdefault(r["request_id"], []).append(r)
  for reqs in out.values():
    for rounds in reqs.values():
      rounds.sort(key=lambda r: r["round"])
  return out


class _Replay:
  """Every logged round of every request, flattened for fast re-scoring at many prices.

  A round's choice depends on rho only through its value vector (V_B(s, z) for each B), so rounds are pooled per
  (request, value vector): per candidate rho only one choice per distinct vector is computed, then gathered."""

  def __init__(self, groups: Mapping[str, Mapping[str, Sequence[Mapping]]], value_model: vm.ValueModel | None,
               costs: Mapping[int, float], cold_start: int | None):
    if not costs:
      raise TablesError("costs must hold at least one block size")
    self.blocks = tuple(sorted(costs))
    for b, t in costs.items():
      if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
        raise TablesError(f"costs[{b}] must be a finite positive number of ms, got {t!r}")
    if cold_start is not None and cold_start not in self.blocks:
      raise TablesError(f"cold_start block {cold_start} is not among the cost blocks {list(self.blocks)}")
    if value_model is not None:
      missing = [b for b in self.blocks if b not in value_model.block_sizes]
      if missing:
        raise TablesError(f"the value model has no block size {missing[0]} (has {list(value_model.block_sizes)})")
    self.T = np.array([float(costs[b]) for b in self.blocks])
    vec_ids: dict[tuple, int] = {}
    req_of, vid_of, a_rows, ds_of_req = [], [], [], []
    n_req = 0
    if not groups:
      raise TablesError("no trace rows to replay")
    for d, (_, reqs) in enumerate(sorted(groups.items())):
      if not reqs:
        raise TablesError("a dataset without requests cannot be macro-averaged")
      for _, rounds in sorted(reqs.items()):
        for r in rounds:
          a = {int(b): v for b, v in r["A"].items()}  # JSON rows key A by strings, validated rows by ints
          missing = [b for b in self.blocks if b not in a]
          if missing:
            raise TablesError(f"row {r['dataset']}/{r['request_id']}/round {r['round']} has no A[{missing[0]}]")
          a_rows.append([a[b] for b in self.blocks])
          if value_model is None or (cold_start is not None and r["round"] == 0):
            vid = -1  # the first round runs the cold-start block whatever rho is (no model: fixed-B replays only)
          else:
            vec = tuple(value_model.value(b, r["s"], r["z"]) for b in self.blocks)
            vid = vec_ids.setdefault(vec, len(vec_ids))
          req_of.append(n_req)
          vid_of.append(vid)
        ds_of_req.append(d)
        n_req += 1
    self.n_datasets = len(groups)
    self.n_req = n_req
    self.ds_of_req = np.array(ds_of_req)
    self.req_per_ds = np.bincount(self.ds_of_req, minlength=self.n_datasets).astype(float)
    self.vectors = np.array(list(vec_ids), np.float64).reshape(len(vec_ids), len(self.blocks))
    self.cold_index = self.blocks.index(cold_start) if cold_start is not None else 0
    # pool rounds per (request, vector id); the cold-start vector gets the id len(vectors)
    vid = np.where(np.array(vid_of) < 0, len(vec_ids), np.array(vid_of))
    key = np.array(req_of) * (len(vec_ids) + 1) + vid
    uniq, inv = np.unique(key, return_inverse=True)
    self.pair_req = uniq // (len(vec_ids) + 1)
    self.pair_vid = uniq % (len(vec_ids) + 1)
    self.pair_a = np.zeros((len(uniq), len(self.blocks)))
    np.add.at(self.pair_a, inv, np.array(a_rows, np.float64))
    self.pair_n = np.bincount(inv, minlength=len(uniq)).astype(float)
    self.rounds_per_req = np.bincount(self.pair_req, weights=self.pair_n, minlength=n_req)

  def vector_choices(self, rho: float) -> np.ndarray:
    """Index into self.blocks per value vector (the cold-start vector last). np.argmax takes the first maximum,
    i.e. the smallest B, exactly like `decide`'s strict '>'."""
    u = self.vectors - rho * self.T[None, :]
    ch = np.argmax(u, axis=1) if len(self.vectors) else np.zeros(0, np.int64)
    return np.append(ch, self.cold_index)

  def _score(self, pair_choice: np.ndarray) -> float:
    take = np.arange(len(pair_choice))
    tokens = np.bincount(self.pair_req, weights=self.pair_a[take, pair_choice], minlength=self.n_req)
    ms = np.bincount(self.pair_req, weights=self.pair_n * self.T[pair_choice], minlength=self.n_req)
    per_ds = np.bincount(self.ds_of_req, weights=tokens / ms, minlength=self.n_datasets) / self.req_per_ds
    return float(per_ds.mean())

  def objective(self, rho: float) -> float:
    return self._score(self.vector_choices(rho)[self.pair_vid])

  def fixed(self, b: int) -> float:
    return self._score(np.full(len(self.pair_vid), self.blocks.index(b)))

  def shares(self, rho: float) -> dict[int, float]:
    """Share of rounds per block, per request, averaged within each dataset, then over datasets (Table 4 style)."""
    ch = self.vector_choices(rho)[self.pair_vid]
    out = {}
    for j, b in enumerate(self.blocks):
      per_req = np.bincount(self.pair_req, weights=self.pair_n * (ch == j), minlength=self.n_req)
      per_req = per_req / self.rounds_per_req
      out[b] = float((np.bincount(self.ds_of_req, weights=per_req, minlength=self.n_datasets) /
                      self.req_per_ds).mean())
    return out

  def candidates(self) -> np.ndarray:
    """{0}, every non-negative breakpoint (V_j - V_i)/(T_j - T_i) over the distinct value vectors, the midpoints
    between consecutive points, max * 1.05 and 33 linspace points over [0, max * 1.05]."""
    pts = [np.zeros(1)]
    nb = len(self.blocks)
    for i in range(nb):
      for j in range(i + 1, nb):
        dt = self.T[j] - self.T[i]
        if dt != 0 and len(self.vectors):
          bp = (self.vectors[:, j] - self.vectors[:, i]) / dt
          pts.append(bp[bp >= 0])
    pts = np.unique(np.concatenate(pts))
    top = float(pts.max()) * 1.05
    extra = [(pts[:-1] + pts[1:]) / 2, [top], np.linspace(0.0, top, LINSPACE_POINTS)]
    return np.unique(np.concatenate([pts] + [np.asarray(e, np.float64) for e in extra]))


@dataclasses.dataclass(frozen=True)
class RhoSolution:
  rho: float
  objective: float  # macro tokens per ms per request under the rule at rho
  shares: Mapping[int, float]  # macro share of rounds per chosen B
  fixed_objectives: Mapping[int, float]  # the same objective with one B for every round
  candidates: int  # prices evaluated

  @property
  def best_fixed_block(self) -> int:
    return max(sorted(self.fixed_objectives), key=lambda b: self.fixed_objectives[b])


def solve_rho(rows_by_request: Mapping[str, Mapping[str, Sequence[Mapping]]], value_model: vm.ValueModel,
              costs: Mapping[int, float], cold_start: int | None = None) -> RhoSolution:
  """The exact 1-D search for rho_C (docs/spec/recguide.md §5.4).

  rows_by_request: {dataset: {request_id: [rows]}} as `group_rows` builds. Each request's logged rounds are
  replayed with B_t chosen by `decide` from the round's own (s, z) (round 0 takes `cold_start` when given); the
  score is the macro over datasets of the mean over requests of sum_t A_{B_t} / sum_t T(B_t). The objective is
  piecewise constant in rho with jumps only at the candidate breakpoints, so scanning the candidates (midpoints
  stand for the open intervals) finds the exact maximum; ties go to the smaller rho."""
  replay = _Replay(rows_by_request, value_model, costs, cold_start)
  best_rho, best = None, -math.inf
  cands = replay.candidates()
  for rho in cands:  # ascending, strict '>': ties keep the smaller rho
    score = replay.objective(float(rho))
    if score > best:
      best_rho, best = float(rho), score
  fixed = {b: replay.fixed(b) for b in replay.blocks}
  return RhoSolution(best_rho, best, types.MappingProxyType(replay.shares(best_rho)),
                     types.MappingProxyType(fixed), len(cands))


def replay_objective(rows_by_request: Mapping[str, Mapping[str, Sequence[Mapping]]], value_model: vm.ValueModel,
                     costs: Mapping[int, float], rho: float, cold_start: int | None = None) -> float:
  """The objective `solve_rho` maximises, at one given rho."""
  return _Replay(rows_by_request, value_model, costs, cold_start).objective(rho)


def fixed_objective(rows_by_request: Mapping[str, Mapping[str, Sequence[Mapping]]], costs: Mapping[int, float],
                    block: int) -> float:
  """The objective with the same block for every round (the fixed-B baselines)."""
  return _Replay(rows_by_request, None, costs, None).fixed(block)
