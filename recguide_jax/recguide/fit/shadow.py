"""Shadow tracing for RecGuide's adaptive block size (offline; docs/spec/recguide.md §5.2): every round runs B = 8,
16 and 32 from the same committed state and logs the counterfactual accepted lengths; the block actually committed
follows the collector's exploration chain (cold start 16; from 8: 55/35/10; from 16: 25/50/25; from 32:
10/35/55), so the history signals cover every stratum. Rows (schema: `traces.py`) feed `launch/fit_tables.py`."""

from __future__ import annotations

import json

import numpy as np

from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.decoding.rounds import draft_verify
from recguide_jax.decoding.strategy import Group, Round, RoundContext, RoundKind, RoundPlan, StepView, Strategy
from recguide_jax.recguide import signals
from recguide_jax.engine.requests import Forward

EXPLORE = {None: {16: 1.0}, 8: {8: 0.55, 16: 0.35, 32: 0.10}, 16: {8: 0.25, 16: 0.50, 32: 0.25},
           32: {8: 0.10, 16: 0.35, 32: 0.55}}


class ShadowRound(Round):
  """From the same committed state, draft + verify at every block size and log the counterfactual accepted
  lengths; commit the chosen one, which runs last so that its K/V are the canonical ones (the others only wrote
  slots past the committed length or slots the chosen verify rewrites)."""
  kind = RoundKind.SHADOW

  def __init__(self, strategy: "ShadowTraceStrategy"):
    self.strategy = strategy

  def run(self, ctx: RoundContext, group: Group) -> None:
    reqs, chosen = group.reqs, group.block
    sizes = self.strategy.block_sizes()
    ctx.reserve(reqs, max(sizes))
    b, page_table, prefix_len, samp = ctx.batch_arrays(reqs)
    seed, write = ctx.seeds(reqs, b)
    counterfactual = [{} for _ in reqs]
    for blk in [x for x in sizes if x != chosen] + [chosen]:
      res = draft_verify(ctx, blk, seed, write, prefix_len, page_table, samp)
      ctx.count_forward(Forward.DRAFT, blk, len(reqs))  # every executed forward is in the ledger
      ctx.count_forward(Forward.VERIFY, blk, len(reqs))
      for i in range(len(reqs)):
        counterfactual[i][blk] = int(res.accepted[i])
    for i, r in enumerate(reqs):
      r.stats.forwards[Forward.DRAFT] += len(sizes)
      r.stats.forwards[Forward.VERIFY] += len(sizes)
      self.strategy.record_shadow(r, counterfactual[i])
      ctx.verified(r, chosen, int(res.accepted[i]), res, i)


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

  def plan(self, req, view: StepView) -> RoundPlan:
    hist = req.strategy_state
    prev = hist[-1].block_size if hist else None
    probs = EXPLORE[prev]
    choice = int(self.rng.choice(list(probs), p=list(probs.values())))
    return RoundPlan(self.round, choice)

  def record_shadow(self, req, accepted_by_block: dict[int, int]) -> None:
    hist = req.strategy_state
    self.rows.append({"dataset": self.dataset, "request_id": req.request_id, "round": len(hist),
                      "s": signals.signal_s(hist), "z": signals.stratum(hist), "head_cap": self.entropy_head_cap,
                      "A": {str(b): int(a) for b, a in accepted_by_block.items()}})

  def observe(self, req, block_size: int, accepted: int, result, row: int) -> None:
    req.strategy_state.append(signals.make_record(result.entropy[row], accepted, block_size,
                                                  head_cap=self.entropy_head_cap))

  def write(self, path) -> None:
    with open(path, "w") as f:
      for row in self.rows:
        f.write(json.dumps(row) + "\n")


