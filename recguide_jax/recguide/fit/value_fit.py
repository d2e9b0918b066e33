"""Fitting RecGuide's value model V_B(s, z) from shadow traces (offline; docs/spec/recguide.md §5.2): per stratum z,
weighted quantile bins of s, binned survival P(A_B >= k | s in bin) made monotone across bins by weighted PAVA."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from recguide_jax.recguide.signals import STRATA
from recguide_jax.recguide.fit.traces import nested_weights, validate_rows
from recguide_jax.recguide.value_model import SurvivalTable, TraceError, ValueModel


def weighted_quantile_edges(s: np.ndarray, w: np.ndarray, bins: int) -> np.ndarray:
  """bins-1 cut points at the weighted quantiles i/bins of s, deduplicated. A cut is the first sorted value whose
  cumulative weight exceeds the quantile, and values equal to a cut go to the upper bin, so each bin holds its
  1/bins share of the weight (up to ties); a cut at the minimum (an always-empty lowest bin) is dropped."""
  order = np.argsort(s, kind="stable")
  ss, cw = s[order], np.cumsum(w[order])
  # the tolerance keeps float round-off in the cumulative sum from moving a cut by one value
  qs = np.arange(1, bins) / bins * cw[-1] + 1e-9 * cw[-1]
  idx = np.clip(np.searchsorted(cw, qs, side="right"), 0, len(ss) - 1)
  edges = np.unique(ss[idx])
  return edges[edges > ss[0]]


def weighted_pava(y: np.ndarray, w: np.ndarray) -> np.ndarray:
  """Weighted isotonic (non-decreasing) least-squares fit by pool-adjacent-violators. Zero-weight points take the
  value of the block they fall in."""
  blocks: list[list[float]] = []  # [mean, weight, count]
  for yi, wi in zip(np.asarray(y, float), np.asarray(w, float)):
    blocks.append([yi, wi, 1])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      m2, w2, c2 = blocks.pop()
      m1, w1, c1 = blocks.pop()
      wt = w1 + w2
      mean = (m1 * w1 + m2 * w2) / wt if wt > 0 else (m1 * c1 + m2 * c2) / (c1 + c2)
      blocks.append([mean, wt, c1 + c2])
  return np.concatenate([np.full(c, m) for m, _, c in blocks]) if blocks else np.zeros(0)


def _survival(a: np.ndarray, w: np.ndarray, b: int) -> np.ndarray:
  """Weighted P(A >= k) for k = 1..b over the given rows."""
  ge = a[:, None] >= np.arange(1, b + 1)[None, :]
  return np.clip((w[:, None] * ge).sum(0) / w.sum(), 0.0, 1.0)  # clip: weighted sums round past 1


def _fit_table(s: np.ndarray, w: np.ndarray, a: Mapping[int, np.ndarray], bins: int) -> SurvivalTable:
  has_s = np.isfinite(s)
  edges = np.zeros(0)
  if has_s.sum() >= max(24, 2 * bins):
    edges = weighted_quantile_edges(s[has_s], w[has_s], bins)
  nb = len(edges) + 1
  idx = np.searchsorted(edges, s[has_s], side="right")
  ws = w[has_s]
  bin_w = np.bincount(idx, weights=ws, minlength=nb)
  survival, unconditional = {}, {}
  for b, ab in a.items():
    uncond = np.minimum.accumulate(_survival(ab, w, b))
    if not has_s.any():
      table = uncond[None, :].copy()
    else:
      ge = (ab[has_s][:, None] >= np.arange(1, b + 1)[None, :]) * ws[:, None]
      sums = np.zeros((nb, b))
      np.add.at(sums, idx, ge)
      with np.errstate(invalid="ignore", divide="ignore"):
        table = np.where(bin_w[:, None] > 0, sums / bin_w[:, None], uncond[None, :])
      # higher s (lower entropy) must never predict a shorter acceptance: isotonic across bins per k
      for k in range(b):
        table[:, k] = weighted_pava(table[:, k], bin_w)
      # a survival function is non-increasing in k (and a probability despite float round-off)
      table = np.minimum.accumulate(np.clip(table, 0.0, 1.0), axis=1)
    survival[b] = table
    unconditional[b] = uncond
  return SurvivalTable(edges, survival, unconditional, rows=int(len(s)), weight=float(w.sum()))


def fit_value_model(rows: Sequence[Mapping], bins: int = 24, strata: bool = True) -> ValueModel:
  """Fits V_B(s, z) (docs/spec/recguide.md §5.2) from shadow-trace rows (see the module docstring).

  Only rounds with history (round >= 1) train. Rows carry nested equal weights. The "all" table is always fitted;
  a z-stratum gets its own table when it has at least max(48, 3*bins) rows. Within a table, s is cut at weighted
  quantiles (when there are at least max(24, 2*bins) rows with s), survival is isotonic non-decreasing in s per k
  and non-increasing in k, and rows without s only shape the unconditional row used when s is undefined."""
  if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
    raise ValueError(f"bins must be a positive integer, got {bins!r}")
  rows = validate_rows(rows)
  train = [r for r in rows if r["round"] >= 1]
  if not train:
    raise TraceError("no trace rows with history (round >= 1) to fit the value model on")
  caps = {r.get("head_cap") for r in train}
  if len(caps) > 1:
    raise TraceError(f"trace rows mix signal head caps {sorted(caps, key=str)}; fit one signal definition at a time")
  blocks = tuple(train[0]["A"])
  w = nested_weights(train)
  s = np.array([np.nan if r["s"] is None else r["s"] for r in train], np.float64)
  a = {b: np.array([r["A"][b] for r in train], np.int64) for b in blocks}
  z = np.array([r["z"] or "" for r in train])
  tables = {"all": _fit_table(s, w, a, bins)}
  if strata:
    need = max(48, 3 * bins)
    for name in STRATA:
      sel = z == name
      if sel.sum() >= need:
        tables[name] = _fit_table(s[sel], w[sel], {b: v[sel] for b, v in a.items()}, bins)
  return ValueModel(tables, blocks, bins, head_cap=caps.pop())
