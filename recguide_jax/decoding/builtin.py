"""The fixed strategies: AR, LinearSS at one block size, NLD block diffusion. They ignore history."""

from __future__ import annotations

from recguide_jax.decoding import rounds
from recguide_jax.decoding.strategy import Round, RoundPlan, StepView, Strategy


class ARStrategy(Strategy):
  name = "ar"
  _plan = RoundPlan(rounds.AR, 1)

  def plan(self, req, view: StepView) -> RoundPlan:
    return self._plan


class FixedBlockStrategy(Strategy):
  """Every request, every round: `round` at one block size."""
  round: Round

  def __init__(self, block_size: int):
    self.block_size = block_size
    self._plan = RoundPlan(self.round, block_size)

  def plan(self, req, view: StepView) -> RoundPlan:
    return self._plan

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
  round = rounds.DIFFUSION
  supports_logprobs = False

  def __init__(self, block_size: int = 32, threshold: float = 0.9):
    if not 0 < threshold <= 1:
      raise ValueError(f"diffusion threshold must be in (0, 1], got {threshold}")
    super().__init__(block_size)
    self.threshold = threshold

  def step_kinds(self):
    return ("prefill", "denoise")
