"""Strategies by name: what `LLM(policy=...)`, the server's `--policy` and the launch scripts accept. A new strategy
registers a factory here (or is passed to `LLM` as an object) and touches no engine code."""

from __future__ import annotations

from typing import Callable

from recguide_jax.decoding.builtin import ARStrategy, DiffusionStrategy, LinearStrategy
from recguide_jax.decoding.strategy import Strategy

# factory(block_size, threshold, **kwargs) -> Strategy
Factory = Callable[..., Strategy]


def _recguide(block_size: int, threshold: float, **kwargs) -> Strategy:
  del threshold
  from recguide_jax.recguide.controller import RecGuideStrategy  # numpy-only, but loaded only when asked for
  return RecGuideStrategy(block_size, **kwargs)


_FACTORIES: dict[str, Factory] = {
    # the fixed strategies take no options; `LLM(policy_kwargs=...)` is passed to every factory
    "ar": lambda block_size, threshold, **_: ARStrategy(),
    "diffusion": lambda block_size, threshold, **_: DiffusionStrategy(block_size, threshold),
    "linear": lambda block_size, threshold, **_: LinearStrategy(block_size),
    "recguide": _recguide,
}


def register_strategy(name: str, factory: Factory, *, replace: bool = False) -> None:
  """Makes `make_strategy(name, block_size, threshold, **kwargs)` call `factory(block_size, threshold, **kwargs)`."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"a strategy name must be a non-empty string, got {name!r}")
  if name in _FACTORIES and not replace:
    raise ValueError(f"a strategy named {name!r} is already registered (pass replace=True to replace it)")
  _FACTORIES[name] = factory


def strategy_names() -> tuple[str, ...]:
  return tuple(_FACTORIES)


def make_strategy(name: str, block_size: int = 16, threshold: float = 0.9, **kwargs) -> Strategy:
  factory = _FACTORIES.get(name)
  if factory is None:
    raise ValueError(f"unknown policy {name!r}; expected one of {strategy_names()}")
  return factory(block_size, threshold, **kwargs)
