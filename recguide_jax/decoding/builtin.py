"""The fixed strategies: AR, LinearSS at one block size, NLD block diffusion. They ignore history."""

from __future__ import annotations

from recguide_jax.decoding import rounds
from recguide_jax.decoding.strategy import AheadPlan, Round, RoundPlan, StepPlan, StepView, Strategy


class FixedStrategy(Strategy):
  """Every request, every round: `round` at one block size."""
  round: Round
  block_size: int = 1

  def plan_step(self, view: StepView) -> StepPlan:
    return StepPlan.uniform(RoundPlan(self.round, self.block_size), len(view.requests))

  def plans_ahead(self, batch) -> AheadPlan:
    return AheadPlan.again(batch)  # history plays no part


class ARStrategy(FixedStrategy):
  name = "ar"
  round = rounds.AR


class FixedBlockStrategy(FixedStrategy):

  def __init__(self, block_size: int):
    self.block_size = block_size

  def block_sizes(self):
    return (self.block_size,)


class LinearStrategy(FixedBlockStrategy):
  """LinearSS with a fixed block size: one draft forward plus one verify forward per round."""
  name = "linear"
  round = rounds.LINEAR

  def __init__(self, block_size: int = 16):
    super().__init__(block_size)

  def step_kinds(self):
    return ("prefill", "draft", "verify")


class DiffusionStrategy(FixedBlockStrategy):
  """NLD's block diffusion `generate`: denoise a block by confidence threshold, then commit it causally."""
  name = "diffusion"
  supports_logprobs = False

  def __init__(self, block_size: int = 32, threshold: float = 0.9):
    if not 0 < threshold <= 1:
      raise ValueError(f"diffusion threshold must be in (0, 1], got {threshold}")
    super().__init__(block_size)
    self.threshold = threshold
    self.round = rounds.DiffusionRound(threshold)

  def step_kinds(self):
    return ("prefill", "denoise")
