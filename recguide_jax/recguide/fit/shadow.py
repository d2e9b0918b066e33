"""Shadow tracing for RecGuide's adaptive block size (offline; docs/spec/recguide.md §5.2): every round runs B = 8,
16 and 32 from the same committed state and logs the counterfactual accepted lengths; the block actually committed
follows the collector's exploration chain (cold start 16; from 8: 55/35/10; from 16: 25/50/25; from 32:
10/35/55), so the history signals cover every stratum. Rows (schema: `traces.py`) feed `launch/fit_tables.py`."""

from __future__ import annotations

import json

import numpy as np

from recguide_jax.decoding.rounds import draft_verify, verified_output
from recguide_jax.decoding.strategy import (Batch, Round, RoundOutcome, RoundOutput, RoundPlan, StepPlan, StepView,
                                            Strategy)
from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide import signals
from recguide_jax.runtime.step_key import StepKind

EXPLORE = {None: {16: 1.0}, 8: {8: 0.55, 16: 0.35, 32: 0.10}, 16: {8: 0.25, 16: 0.50, 32: 0.25},
           32: {8: 0.10, 16: 0.35, 32: 0.55}}


class ShadowRound(Round):
  """From the same committed state, draft + verify at every block size and log the counterfactual accepted
  lengths; commit the chosen one, which runs last so that its K/V are the canonical ones (the others only wrote
  slots past the committed length or slots the chosen verify rewrites)."""
  kind = "shadow"

  def __init__(self, strategy: "ShadowTraceStrategy"):
    self.strategy = strategy

  def reserve(self, block: int, steps: int) -> int:
    return max(self.strategy.block_sizes())

  def run(self, runner, batch: Batch) -> RoundOutput:
    n, chosen = batch.n, batch.block
    sizes = self.strategy.block_sizes()
    counterfactual = [{} for _ in range(n)]
    forwards = []
    for blk in [x for x in sizes if x != chosen] + [chosen]:
      res = draft_verify(runner, blk, batch)
      forwards += [(StepKind.DRAFT, blk, n), (StepKind.VERIFY, blk, n)]  # every executed forward is in the ledger
      for i in range(n):
        counterfactual[i][blk] = int(res.accepted[i])
    each = np.full((n,), len(sizes), np.int64)
    return verified_output(self.kind, res, batch, res.accepted[:n].astype(np.int64), forwards,
                           {StepKind.DRAFT: each, StepKind.VERIFY: each}, extra=counterfactual)


class ShadowTraceStrategy(Strategy):
  name = "shadow"

  def __init__(self, dataset: str = "gsm8k", seed: int = 0, entropy_head_cap: int | None = None):
    self.dataset = dataset
    self.rng = np.random.default_rng(seed)
    self.entropy_head_cap = entropy_head_cap
    self.rows: list[dict] = []
    self.round = ShadowRound(self)

  def block_sizes(self):
    return BLOCK_SIZES

  def step_kinds(self):
    return ("prefill", "draft", "verify")

  def on_admit(self, req) -> None:
    req.strategy_state = []  # the request's verification history (signals.RoundRecord)

  def plan_step(self, view: StepView) -> StepPlan:
    plans = []
    for req in view.requests:
      hist = req.strategy_state
      prev = hist[-1].block_size if hist else None
      probs = EXPLORE[prev]
      plans.append(RoundPlan(self.round, int(self.rng.choice(list(probs), p=list(probs.values())))))
    return StepPlan(tuple(plans))

  def record_shadow(self, req, accepted_by_block: dict[int, int]) -> None:
    hist = req.strategy_state
    self.rows.append({"dataset": self.dataset, "request_id": req.request_id, "round": len(hist),
                      "s": signals.signal_s(hist), "z": signals.stratum(hist), "head_cap": self.entropy_head_cap,
                      "A": {str(b): int(a) for b, a in accepted_by_block.items()}})

  def observe(self, outcome: RoundOutcome) -> None:
    out = outcome.output
    for i, req in enumerate(outcome.batch.reqs):
      self.record_shadow(req, out.extra[i])
      req.strategy_state.append(signals.make_record(out.verify.entropy[i], int(out.accepted[i]), int(out.block[i]),
                                                    head_cap=self.entropy_head_cap))

  def write(self, path) -> None:
    with open(path, "w") as f:
      for row in self.rows:
        f.write(json.dumps(row) + "\n")


