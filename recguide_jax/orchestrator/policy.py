"""The RecGuide controller: per request and round, overlap (light load), adaptive block size (heavier load) or
plain AR decoding, whichever gives the most tokens per unit of (profiled) time at the current concurrency.

- Overlap (recguide.md section 4) runs for greedy requests; its branch plan comes from `overlap.plan_branches`.
- Adaptive B (section 5) picks B in {8, 16, 32} per request from its verification history: with fitted value
  tables (`AdaptivePolicyTables`) by argmax_B V_B(s, z) - rho_C T_C(B); without tables, from online estimates of
  the accepted length per B and the profile's cost.
- The switch (section 6, ours): compares the expected rate of each regime, E[tokens]/E[time], using the hardware
  profile (measured here or loaded) and the engine's observed acceptance and overlap hit rates. AR (B = 1) is a
  candidate too, so speculation never runs where it loses to plain decoding.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from recguide_jax.orchestrator import overlap as ov
from recguide_jax.policies import Policy, RoundPlan

BLOCKS = (8, 16, 32)
PAPER_DELTA = 0.5  # risky-position margin threshold of the paper (NLD-8B)


@dataclasses.dataclass
class OnlineStats:
  """Engine-wide running estimates the switch needs (exponential moving averages)."""
  decay: float = 0.98
  accepted: dict = dataclasses.field(default_factory=lambda: {8: 4.0, 16: 5.0, 32: 6.0})
  overlap_accepted: float = 5.0
  overlap_hit: float = 0.5
  overlap_rounds: int = 0

  def observe_linear(self, blk: int, accepted: int) -> None:
    self.accepted[blk] = self.decay * self.accepted.get(blk, accepted) + (1 - self.decay) * accepted

  def observe_overlap(self, accepted: int, hit: bool) -> None:
    d = self.decay
    self.overlap_accepted = d * self.overlap_accepted + (1 - d) * accepted
    self.overlap_hit = d * self.overlap_hit + (1 - d) * float(hit)
    self.overlap_rounds += 1


class RecGuidePolicy(Policy):
  name = "recguide"

  def __init__(self, block_size: int = 16, *, delta: float | None = None, planner: str | None = None,
               components=("p1", "p2", "continuation"),
               overlap: bool = True, adaptive: bool = True, switch: bool = True, profile=None, tables=None,
               fixed_regime: str | None = None, entropy_head_cap: int | None = None):
    if block_size not in BLOCKS:
      raise ValueError(f"recguide block_size must be one of {BLOCKS}, got {block_size}")
    self.block_size = block_size
    if delta is None:  # the threshold fitted with the tables (launch/fit_delta.py), else the paper's
      delta = tables.overlap_delta if tables is not None and tables.overlap_delta is not None else PAPER_DELTA
    self.delta = delta
    if planner is None:  # the branch planner fitted with the tables, else the paper's no-P3 rule
      planner = tables.overlap_planner if tables is not None and tables.overlap_planner else ov.PLANNERS[0]
    if planner not in ov.PLANNERS:
      raise ValueError(f"planner must be one of {ov.PLANNERS}, got {planner!r}")
    self.planner = planner
    self.components = tuple(components)
    self.overlap = overlap
    self.adaptive = adaptive
    self.switch = switch
    self.profile = profile
    self.tables = tables
    self.fixed_regime = fixed_regime  # "overlap" | "adaptive" | "linear" | "ar": bypasses the switch (ablations)
    self.entropy_head_cap = entropy_head_cap
    self.stats = OnlineStats()
    if tables is not None:  # start the online estimates from the fitted model's unconditional values
      self.stats.accepted = {b: tables.value_model.value(b, None) for b in BLOCKS}
      self.stats.overlap_accepted = self.stats.accepted[block_size]
    self.regime_counts = collections.Counter()
    self._regime_memo: tuple = (None, None)

  def block_sizes(self):
    return BLOCKS

  def step_kinds(self):
    return ("prefill", "draft", "verify", "fused", "gverify")

  # ---- costs ---------------------------------------------------------------------------------------------------------
  def _cost(self, concurrency: int, blk: int) -> float:
    if self.profile is None:  # no profile: relative costs of a compute-bound device (tokens processed)
      return 1.0 + blk / 32.0
    return self.profile.cost(concurrency, blk)

  def round_cost(self, batch: int, block_size: int) -> float:
    return self._cost(batch, block_size)

  def _ar_cost(self, concurrency: int) -> float:
    if self.profile is None or getattr(self.profile, "ar_step_ms", None) is None:
      return 0.5 * self._cost(concurrency, 8)
    return self.profile.ar_cost(concurrency)

  def _fused_cost(self, concurrency: int, blk: int) -> float:
    if self.profile is None:
      return 0.5 * (1.0 + 4 * blk / 32.0)
    return self.profile.fused_cost(concurrency, blk)

  # ---- regime switch -------------------------------------------------------------------------------------------------
  def expected_rates(self, concurrency: int) -> dict[str, float]:
    """Tokens per unit time per request for each regime at this concurrency."""
    c = max(concurrency, 1)
    rates = {"ar": 1.0 / self._ar_cost(c)}
    for blk in BLOCKS:
      rates[f"linear{blk}"] = self.stats.accepted[blk] / self._cost(c, blk)
    blk = self.block_size
    t_draft = self._cost(c, blk) / 2  # draft and verify cost about the same (recguide.md 7.6)
    rates["overlap"] = self.stats.overlap_accepted / (self._fused_cost(c, blk) + (1 - self.stats.overlap_hit) * t_draft)
    return rates

  def regime(self, concurrency: int) -> str:
    if self.fixed_regime:
      return self.fixed_regime
    if not self.switch:
      return "overlap" if (self.overlap and concurrency <= 1) else "adaptive"
    rates = self.expected_rates(concurrency)
    if not self.overlap:
      rates.pop("overlap")
    best = max(rates, key=rates.get)
    if best == "ar":
      return "ar"
    if best == "overlap":
      return "overlap"
    return "adaptive"

  # ---- per request ---------------------------------------------------------------------------------------------------
  _eos: np.ndarray = np.zeros((0,), np.int64)  # the engine's EOS ids, refreshed with the per-step memo

  def on_admit(self, req) -> None:
    req.policy_state["history"] = []

  def _adaptive_block(self, req, concurrency: int) -> int:
    hist = req.policy_state.get("history", [])
    if not self.adaptive:
      return self.block_size
    if self.tables is not None:  # rho is a price against the costs it was solved with: use the tables' own
      return self.tables.next_block(max(concurrency, 1), hist)
    # no fitted tables: the best online estimate of accepted length per cost
    c = max(concurrency, 1)
    scores = {b: self.stats.accepted[b] / self._cost(c, b) for b in BLOCKS}
    return max(BLOCKS, key=lambda b: (scores[b], -b))

  def plan(self, req, engine) -> RoundPlan:
    concurrency = engine.decoding_count
    # the regime depends only on the load and engine-wide estimates: decide it once per engine step, not per
    # request (per-request Python work showed up as a few % of an AR step at high concurrency)
    key = (engine.step_count, concurrency)
    if self._regime_memo[0] != key:
      self._regime_memo = (key, self.regime(concurrency))
      self._eos = np.asarray(engine.cfg.eos_token_ids)
    regime = self._regime_memo[1]
    greedy = req.params.temperature <= 0
    if regime == "overlap" and not greedy:
      regime = "adaptive"  # the reuse rules assume greedy matching
    self.regime_counts[regime] += 1
    if regime == "overlap":
      return RoundPlan("overlap", self.block_size)
    if regime == "ar":
      return RoundPlan("ar", 1)
    if regime == "linear":
      return RoundPlan("linear", self.block_size)
    return RoundPlan("linear", self._adaptive_block(req, concurrency))

  def plan_branches(self, req, signals: np.ndarray, blk: int, engine) -> list:
    bounds = dict(generated=len(req.output_ids), committed=engine.allocator.length(req.request_id),
                  max_new=req.params.max_tokens, max_len=engine.rc.max_model_len + engine.rc.max_block)
    if self.planner == "expected_hit":
      return ov.plan_expected_hit(signals, blk, **bounds)
    return ov.plan_branches(ov.analyze(signals, self.delta), blk, components=self.components, **bounds)

  def observe(self, req, block_size: int, accepted: int, result, row: int) -> None:
    if block_size <= 1:
      return
    from recguide_jax.orchestrator import value_model as vm
    hist = req.policy_state.setdefault("history", [])
    cap = self.tables.head_cap if self.tables is not None else self.entropy_head_cap
    eos = bool(np.isin(result.tokens[row, :accepted], self._eos).any())
    ent = vm.round_entropy(result.entropy[row], accepted, block_size, eos=eos, head_cap=cap)
    hist.append({"B": block_size, "accepted": accepted, "full": accepted == block_size, "e": ent})
    if len(hist) > 4:
      del hist[0]
    if getattr(result, "kind", "linear") == "linear" and block_size in BLOCKS:
      self.stats.observe_linear(block_size, accepted)

  def observe_overlap(self, req, accepted: int, hit: bool) -> None:
    self.stats.observe_overlap(accepted, hit)
