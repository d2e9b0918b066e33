"""Decoding policies: per request and round, which step kind runs and with which block size.

This is the seam the RecGuide controller plugs into: `plan` is asked before every round, `observe` after every
verification. The fixed policies below ignore history; RecGuide uses it to pick B (and overlap) per request.
"""

from __future__ import annotations

import dataclasses

POLICY_NAMES = ("ar", "diffusion", "linear", "recguide")


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  kind: str  # "ar" | "linear" | "diffusion"
  block_size: int  # 1 for ar


class Policy:
  name = "base"
  threshold = 0.9  # confidence threshold of the diffusion denoise loop
  supports_logprobs = True

  def plan(self, req, engine) -> RoundPlan:
    raise NotImplementedError

  def observe(self, req, block_size: int, accepted: int, result, row: int) -> None:
    """Called after each verification of `req` (result: the runner's VerifyResult, row: req's row in it)."""

  def observe_round(self, kind: str, block_size: int, rows: int, seconds: float) -> None:
    """Called after every decode round the engine runs for this policy: the round's kind ("ar", "linear",
    "overlap" / "overlap_draft" when it also ran a draft forward, ...), block size, live rows and wall seconds."""

  def on_admit(self, req) -> None:
    pass

  def on_finish(self, req) -> None:
    pass

  def block_sizes(self) -> tuple[int, ...]:
    """Block sizes this policy may plan (what must be compiled)."""
    return ()

  def step_kinds(self) -> tuple[str, ...]:
    return ("prefill", "verify")

  def round_cost(self, batch: int, block_size: int) -> float | None:
    """Cost of one LinearSS round (draft + verify) of `batch` requests at block `block_size` in the policy's cost
    model, or None when it has none (the engine then keeps one batch per planned block size)."""
    del batch, block_size
    return None


class ARPolicy(Policy):
  name = "ar"

  def plan(self, req, engine) -> RoundPlan:
    return RoundPlan("ar", 1)


class LinearPolicy(Policy):
  """LinearSS with a fixed block size: one draft forward plus one verify forward per round."""
  name = "linear"

  def __init__(self, block_size: int = 16):
    self.block_size = block_size

  def plan(self, req, engine) -> RoundPlan:
    return RoundPlan("linear", self.block_size)

  def block_sizes(self):
    return (self.block_size,)

  def step_kinds(self):
    return ("prefill", "draft", "verify")


class DiffusionPolicy(Policy):
  """NLD's block diffusion `generate`: denoise a block by confidence threshold, then commit it causally."""
  name = "diffusion"
  supports_logprobs = False

  def __init__(self, block_size: int = 32, threshold: float = 0.9):
    if not 0 < threshold <= 1:
      raise ValueError(f"diffusion threshold must be in (0, 1], got {threshold}")
    self.block_size = block_size
    self.threshold = threshold

  def plan(self, req, engine) -> RoundPlan:
    return RoundPlan("diffusion", self.block_size)

  def block_sizes(self):
    return (self.block_size,)

  def step_kinds(self):
    return ("prefill", "denoise")


def make_policy(name: str, block_size: int = 16, threshold: float = 0.9, **recguide_kwargs) -> Policy:
  if name == "ar":
    return ARPolicy()
  if name == "linear":
    return LinearPolicy(block_size)
  if name == "diffusion":
    return DiffusionPolicy(block_size, threshold)
  if name == "recguide":
    from recguide_jax.orchestrator.policy import RecGuidePolicy
    return RecGuidePolicy(block_size, **recguide_kwargs)
  raise ValueError(f"unknown policy {name!r}; expected one of {POLICY_NAMES}")
