"""Shadow tracing for RecGuide's adaptive block size (recguide.md section 5.2): every round runs B = 8, 16 and 32
from the same committed state and logs the counterfactual accepted lengths; the block actually committed follows
the collector's exploration chain (cold start 16; from 8: 55/35/10; from 16: 25/50/25; from 32: 10/35/55), so the
history signals cover every stratum. Rows feed `launch/fit_policy.py`."""

from __future__ import annotations

import json

import numpy as np

from recguide_jax.policies import Policy, RoundPlan

BLOCKS = (8, 16, 32)
EXPLORE = {None: {16: 1.0}, 8: {8: 0.55, 16: 0.35, 32: 0.10}, 16: {8: 0.25, 16: 0.50, 32: 0.25},
           32: {8: 0.10, 16: 0.35, 32: 0.55}}


class ShadowTracePolicy(Policy):
  name = "shadow"

  def __init__(self, dataset: str = "gsm8k", seed: int = 0, entropy_head_cap: int | None = None):
    self.dataset = dataset
    self.rng = np.random.default_rng(seed)
    self.entropy_head_cap = entropy_head_cap
    self.rows: list[dict] = []

  def block_sizes(self):
    return BLOCKS

  def step_kinds(self):
    return ("prefill", "draft", "verify")

  def on_admit(self, req) -> None:
    req.policy_state["history"] = []

  def plan(self, req, engine) -> RoundPlan:
    hist = req.policy_state["history"]
    prev = hist[-1]["B"] if hist else None
    probs = EXPLORE[prev]
    choice = int(self.rng.choice(list(probs), p=list(probs.values())))
    return RoundPlan("shadow", choice)

  def record_shadow(self, req, accepted_by_block: dict[int, int]) -> None:
    from recguide_jax.orchestrator import value_model as vm
    hist = req.policy_state["history"]
    self.rows.append({"dataset": self.dataset, "request_id": req.request_id, "round": len(hist),
                      "s": vm.signal_s(hist), "z": vm.stratum(hist), "head_cap": self.entropy_head_cap,
                      "A": {str(b): int(a) for b, a in accepted_by_block.items()}})

  def observe(self, req, block_size: int, accepted: int, result, row: int) -> None:
    from recguide_jax.orchestrator import value_model as vm
    ent = vm.round_entropy(result.entropy[row], accepted, block_size, head_cap=self.entropy_head_cap)
    req.policy_state["history"].append({"B": block_size, "accepted": accepted, "full": accepted == block_size,
                                        "e": ent})

  def write(self, path) -> None:
    with open(path, "w") as f:
      for row in self.rows:
        f.write(json.dumps(row) + "\n")
