"""RecGuide's adaptive block size (docs/spec/recguide.md §5) and its batch pricing (ours): per request, B in
{8, 16, 32} from its verification history (the fitted value tables' V_B(s, z) - rho_C T_C(B); with tables priced
for other hardware the same rule over this strategy's own costs, rho rescaled to their time unit; without tables,
online estimates), and a step's
per-request choices priced together as the batch the engine runs them as, against every fixed B and AR
(`decoding.grouping`)."""

from __future__ import annotations

import collections
import operator
from typing import Mapping, Sequence

import numpy as np

from recguide_jax.decoding import grouping
from recguide_jax.decoding.strategy import RoundKind
from recguide_jax.engine.requests import output_lengths
from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide import pricing
from recguide_jax.recguide.config import Regime


_MAX_TOKENS = operator.attrgetter("params.max_tokens")


def remaining_tokens(reqs) -> np.ndarray:
  """Tokens each of `reqs` may still emit (its max_tokens budget; `AdaptiveRule._remaining` of each, read at C
  speed: every step reads them for every request)."""
  return np.fromiter(map(_MAX_TOKENS, reqs), np.int64, len(reqs)) - output_lengths(reqs)


def block_columns(blocks: Sequence[int]) -> np.ndarray:
  """The `_value_rows` column of each block of `blocks` (each one of `BLOCK_SIZES`)."""
  return np.searchsorted(np.asarray(BLOCK_SIZES), np.asarray(blocks, np.int64))


class AdaptiveRule:
  """Mixin of `RecGuideStrategy` (with `CostModel`): reads `tables`, `adaptive`, `calibrate`, `value_calibration`,
  `stats` and the requests' `histories` rows (`_rows`)."""

  @staticmethod
  def _remaining(req) -> int:
    """Tokens `req` may still emit (its max_tokens budget)."""
    return req.params.max_tokens - len(req.output_ids)

  def _values(self, req) -> dict[int, float]:
    """Expected tokens of `req`'s next LinearSS round per B (`_value_rows` of it alone)."""
    return dict(zip(BLOCK_SIZES, self._value_rows([req])[0].tolist()))

  def _value_rows(self, reqs, at: np.ndarray | None = None) -> np.ndarray:
    """Expected tokens of each of `reqs`' next LinearSS round per B, one row per request and a column per B of
    `BLOCK_SIZES`: the fitted value model V_B(s, z) from its history (unconditional before its first
    verification), scaled by how it has matched verification on this workload when calibrating
    (`ValueCalibration`), else the engine-wide online estimate; near the end of its budget, of the tokens it may
    still emit (a longer block buys nothing past max_tokens). One array for a step's requests: every step prices
    all of them. `at`: their `histories` rows, when read already."""
    left = remaining_tokens(reqs)
    if self.tables is None:
      accepted = self.stats.accepted
      return np.minimum(np.array([accepted[b] for b in BLOCK_SIZES], np.float64)[None, :], left[:, None])
    rows = self._model_value_rows(self._rows(reqs) if at is None else at, left)
    if self.calibrate:
      rows *= np.array([self.value_calibration.scale(b) for b in BLOCK_SIZES], np.float64)[None, :]
    return rows

  def _model_value_rows(self, at: np.ndarray, left: np.ndarray) -> np.ndarray:
    """The fitted value model's V_B(s, z) of the next round of the requests at `histories` rows `at`, capped at
    their `left` tokens, a column per B of `BLOCK_SIZES`: one gather from the model's `ValueGrid` at each
    request's grid row (`Histories.grid_rows`)."""
    model = self.tables.value_model
    grid = model.grid
    # a budget short of the longest block caps every B's value (`values_capped`), else V_B as it stands
    caps = np.where(left < BLOCK_SIZES[-1], np.maximum(left, 0), grid.uncapped)
    return grid.values[self.histories.grid_rows(at, model)[:, None], self._grid_columns(model)[None, :],
                       caps[:, None]]

  @staticmethod
  def _grid_columns(model) -> np.ndarray:
    """The `ValueGrid` column of each B of `BLOCK_SIZES` in `model`."""
    return np.array([model.block_sizes.index(b) for b in BLOCK_SIZES], np.int64)

  def _adaptive_block(self, req, concurrency: int, costs: dict[int, float] | None = None) -> int:
    """The per-request rule for one request (`_rule_blocks`). `costs`: the LinearSS round cost per B at this
    concurrency when the caller has them."""
    c = max(concurrency, 1)
    return self._rule_blocks([req], c, self._linear_costs(c) if costs is None else costs)[0]

  def _rule_blocks(self, reqs, c: int, costs: dict[int, float], values: np.ndarray | None = None,
                   at: np.ndarray | None = None) -> list[int]:
    """The per-request rule's block for each of `reqs` at load `c` (`values`: their `_value_rows`, `at`: their
    `histories` rows, when the caller has them): the tables' own rule V - rho T where they were priced on this
    profile (cold-start block before a request's first verification), the same rule rho rescaled to this policy's
    costs for tables of other hardware, argmax V / T without tables (the smaller block on ties, as
    `adaptive.decide`)."""
    if not self.adaptive:
      return [self.block_size] * len(reqs)
    tables = self.tables
    if not reqs:
      return []
    at = self._rows(reqs) if at is None and tables is not None else at
    if tables is not None and self._tables_priced_here:  # `tables.next_block`, on the requests' grid rows
      level, by_row = tables.grid_rule(c)
      blocks = by_row[self.histories.grid_rows(at, tables.value_model)]
      blocks[self.histories.count[at] == 0] = level.cold_start_block  # not verified yet: the cold-start block
      return blocks.tolist()
    values = self._value_rows(reqs, at) if values is None else values
    if tables is None:  # argmax V / T, the smaller block on ties
      cost = np.array([costs[b] for b in BLOCK_SIZES], np.float64)
      return np.asarray(BLOCK_SIZES)[np.argmax(values / cost, axis=1)].tolist()
    # tables of other hardware keep the fitted rule V - rho T on this policy's own costs, rho rescaled to their time
    # unit (`pricing.rescaled_rho`): V / T is a different rule, one the paper's search rejected
    blocks = pricing.decide_rescaled_rows(values, tables.rho_for(c), tables.costs_for(c), costs)
    blocks[self.histories.count[at] == 0] = tables.level(c).cold_start_block
    return blocks.tolist()

  def price_step(self, reqs, concurrency: int, values=None) -> tuple[str, list[int]]:
    """The plan for a step's adaptive requests, priced as a batch: (name, block per request, 1 for AR). `values`:
    their `_value_rows`, when the caller has them.

    Candidates: the per-request rule's blocks and the plans that give every request the same block (each B, and
    AR unless the regime is pinned). A plan's expected tokens are the sum of its requests' values (`_values`; 1
    per AR step), its cost the rounds the engine will run for it, mixed blocks batched the cheapest way
    (`grouping.plan_cost`, as the engine's "auto" grouping does), every round priced by this strategy's cost model
    (`round_cost`). The step runs the plan with the most tokens per unit time; a near-tie keeps the plan listed
    first (AR, then B ascending, then the rule: the cheaper round, and a fixed plan before the mixed one): a later
    plan replaces the best so far only when priced more than `tie_margin` above it (docs/recguide.md, "Priced as a
    batch" (5)). A probe's step runs as the switch chose it, unpriced: every row at the probed block."""
    c = max(concurrency, 1)
    if self.probing and (self._probe_basis or "").startswith(Regime.LINEAR):
      # a probe runs the block whose measurement it refreshes, every row alike: the rule's own blocks would measure
      # other keys (and cost more than the probe was budgeted at when they are longer)
      return "probe", [int(self._probe_basis[len(Regime.LINEAR):])] * len(reqs)
    costs = self._linear_costs(c)
    at = self._rows(reqs) if self.tables is not None else None
    values = self._value_rows(reqs, at) if values is None else values
    rule = self._rule_blocks(reqs, c, costs, values, at)
    if not self.batch_priced or self.probing or not reqs:
      return "rule", rule
    n = len(reqs)
    best_name, best_block, best_rate = "rule", None, -1.0  # best_block: every row's (None: the rule's blocks)
    if self.switch and not self.fixed_regime:  # AR is the switch's candidate (a pinned regime stays LinearSS)
      best_name, best_block, best_rate = Regime.AR.value, 1, n / self._round_cost(RoundKind.AR, 1, n)
    columns = values.sum(axis=0).tolist()
    # (each plan priced by its rows per block: a fixed plan's are one count, not a list of n rows)
    candidates = [(f"linear{b}", b, {b: n}, tokens) for b, tokens in zip(BLOCK_SIZES, columns)]
    candidates.append(("rule", None, collections.Counter(rule),
                       float(values[np.arange(n), block_columns(rule)].sum())))
    for name, block, counts, tokens in candidates:
      rate = tokens / self.plan_cost(counts)
      if rate > best_rate * (1 + max(self.tie_margin, 1e-9)):
        best_name, best_block, best_rate = name, block, rate
    return best_name, rule if best_block is None else [best_block] * n

  def plan_cost(self, counts: Mapping[int, int]) -> float:
    """The cost of one step planned as `counts` (rows per block) as the engine will run it: on ragged steps
    (`ragged_steps`, from the step's view) one ragged draft + verify forward whatever the mix, priced by the profile
    (`pricing.ragged_counts_cost`); else the cheapest split into padded batches (`grouping.plan_cost`)."""
    if self.ragged_steps and self.profile is not None and not self.calibrate:
      return pricing.ragged_counts_cost(counts, self.profile)
    return grouping.plan_cost(counts, self.round_cost)

  @property
  def _tables_priced_here(self) -> bool:
    """True when the tables' rho was solved against this policy's profile (same profile name)."""
    return self.profile is not None and bool(self.profile.name) and self.tables.profile == self.profile.name
