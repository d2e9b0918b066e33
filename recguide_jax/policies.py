"""Earlier names of the decoding strategies ("policies"), kept so existing code keeps working. New code imports
from `recguide_jax.decoding` (`strategy`, `builtin`, `registry`)."""

from recguide_jax.decoding.builtin import ARStrategy, DiffusionStrategy, LinearStrategy
from recguide_jax.decoding.registry import make_strategy, register_strategy, strategy_names
from recguide_jax.decoding.strategy import RoundPlan, StepView, Strategy

Policy = Strategy
ARPolicy = ARStrategy
LinearPolicy = LinearStrategy
DiffusionPolicy = DiffusionStrategy
make_policy = make_strategy
POLICY_NAMES = strategy_names()  # the built-in names; `strategy_names()` includes registered ones

__all__ = ["ARPolicy", "ARStrategy", "DiffusionPolicy", "DiffusionStrategy", "LinearPolicy", "LinearStrategy",
           "POLICY_NAMES", "Policy", "RoundPlan", "StepView", "Strategy", "make_policy", "make_strategy",
           "register_strategy", "strategy_names"]
