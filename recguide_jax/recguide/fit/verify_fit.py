"""Calibrating the draft's running confidence as an acceptance probability, what verify truncation prices a drafted
token by (launch/fit_verify_calibration.py): from LinearSS rounds (each draft's top probability per slot and what
verification accepted), the exponent gamma of P(draft accepted through token j) ~ (prod_{i <= j} c_i)^gamma with
the highest Bernoulli likelihood, and the reliability table it is judged by."""

from __future__ import annotations

from typing import Sequence

import numpy as np

GAMMA_GRID = tuple(np.round(np.arange(0.1, 2.0001, 0.05), 2).tolist())


def running_confidence(confidence: Sequence[np.ndarray], accepted: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """Per drafted token of every round: (its running product of the draft's top probabilities, whether verification
  accepted the draft through it). `confidence[r]` [B] holds slot 0 (the seed) and the B - 1 drafted tokens of round
  r; `accepted[r]` its emitted tokens (accepted drafts + 1)."""
  if len(confidence) != len(accepted):
    raise ValueError(f"{len(confidence)} rounds of confidences, {len(accepted)} accepted lengths")
  pis, hits = [], []
  for conf, a in zip(confidence, accepted):
    conf = np.asarray(conf, np.float64)
    if conf.ndim != 1 or not 1 <= int(a) <= len(conf):
      raise ValueError(f"a round needs confidences [B] and 1 <= accepted <= B, got {conf.shape} and {a}")
    pis.append(np.cumprod(conf[1:]))
    hits.append(np.arange(1, len(conf)) <= int(a) - 1)
  if not pis:
    raise ValueError("no rounds to calibrate on")
  return np.concatenate(pis), np.concatenate(hits)


def log_likelihood(pi: np.ndarray, hit: np.ndarray, gamma: float) -> float:
  """Mean Bernoulli log-likelihood of `hit` under P = pi^gamma."""
  p = np.clip(np.clip(pi, 1e-12, 1.0) ** gamma, 1e-9, 1.0 - 1e-9)
  return float(np.mean(np.where(hit, np.log(p), np.log1p(-p))))


def fit_confidence_exponent(pi: np.ndarray, hit: np.ndarray, grid: Sequence[float] = GAMMA_GRID
                            ) -> tuple[float, dict[float, float]]:
  """The gamma of `grid` with the highest likelihood (`log_likelihood`; ties to the one nearer 1, the plain
  product); returns (gamma, {gamma: log-likelihood})."""
  scores = {float(g): log_likelihood(pi, hit, float(g)) for g in grid}
  best = max(scores, key=lambda g: (round(scores[g], 9), -abs(g - 1.0)))
  return best, scores


def reliability(pi: np.ndarray, hit: np.ndarray, gamma: float,
                edges: Sequence[float] = (0.0, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 0.6, 1.0)) -> list[dict]:
  """Per bin of the running confidence: drafted tokens, mean confidence, the calibrated probability and the
  acceptance rate verification measured."""
  out = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    m = (pi >= lo) & ((pi < hi) if hi < 1.0 else (pi <= hi))
    if m.any():
      out.append({"from": lo, "to": hi, "tokens": int(m.sum()), "running_confidence": float(pi[m].mean()),
                  "calibrated": float(np.mean(pi[m] ** gamma)), "accepted_rate": float(hit[m].mean())})
  return out
