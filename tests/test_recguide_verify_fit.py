"""The draft-confidence calibration verify truncation prices tokens by (recguide/fit/verify_fit.py) and its place in
the tables and RecGuide's configuration."""

import dataclasses

import numpy as np
import pytest

from recguide_jax.recguide import adaptive
from recguide_jax.recguide.fit import verify_fit


def _rounds(gamma, n=4000, block=16, seed=0):
  """Rounds whose draft is accepted through token j with probability exactly (running confidence)^gamma."""
  rng = np.random.default_rng(seed)
  confidence, accepted = [], []
  for _ in range(n):
    conf = np.concatenate([[1.0], rng.uniform(0.2, 1.0, block - 1)])
    p = np.cumprod(conf[1:]) ** gamma
    # accepted through j given through j - 1 with probability p_j / p_{j-1}
    step = p / np.concatenate([[1.0], p[:-1]])
    k = 0
    while k < block - 1 and rng.random() < step[k]:
      k += 1
    confidence.append(conf)
    accepted.append(k + 1)
  return confidence, accepted


@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_fit_recovers_the_exponent_of_synthetic_rounds(gamma):
  pi, hit = verify_fit.running_confidence(*_rounds(gamma))
  fitted, scores = verify_fit.fit_confidence_exponent(pi, hit)
  assert abs(fitted - gamma) <= 0.1, (fitted, gamma)
  assert scores[fitted] >= scores[1.0]
  rows = verify_fit.reliability(pi, hit, fitted)
  assert sum(r["tokens"] for r in rows) == len(pi)
  for r in rows:
    if r["tokens"] > 500:  # calibrated where it has data
      assert abs(r["calibrated"] - r["accepted_rate"]) < 0.05, r


def test_running_confidence_reads_each_round_through_what_it_accepted():
  pi, hit = verify_fit.running_confidence([np.array([1.0, 0.5, 0.5, 1.0])], [2])
  assert pi.tolist() == [0.5, 0.25, 0.25] and hit.tolist() == [True, False, False]
  with pytest.raises(ValueError, match="accepted"):
    verify_fit.running_confidence([np.ones(4)], [5])


def test_tables_carry_the_exponent_and_recguide_resolves_it():
  from recguide_jax.recguide.config import RecGuideConfig
  from recguide_jax.recguide.profile import load_profile
  from tests import test_recguide_priced as tp
  tables = tp._tables(load_profile("b200_nld8b"), 0.1)
  assert RecGuideConfig(tables=tables).verify_confidence_exponent == 1.0  # unfitted: the plain product
  fitted = dataclasses.replace(tables, verify_confidence_exponent=0.65, version="")
  back = adaptive.RecGuideTables.from_json(fitted.to_json())
  assert back.verify_confidence_exponent == 0.65 and back.version == fitted.version != tables.version
  assert RecGuideConfig(tables=back).verify_confidence_exponent == 0.65
  assert RecGuideConfig(tables=back, verify_confidence_exponent=0.8).verify_confidence_exponent == 0.8
  with pytest.raises(adaptive.TablesError, match="verify_confidence_exponent"):
    dataclasses.replace(tables, verify_confidence_exponent=3.0)
  with pytest.raises(ValueError, match="verify_confidence_exponent"):
    RecGuideConfig(verify_confidence_exponent=0.0)
