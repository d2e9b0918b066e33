"""`build_engine`: the one way the offline `LLM` (and through it the server) gets its engine: a plain `Engine` for
one group, a `DataParallelEngine` over one `Engine` per dp group of the mesh; either is a `ServingEngine`."""

from __future__ import annotations

from recguide_jax.engine.protocol import ServingEngine


def build_engine(model, runner_config, strategy, *, mesh=None, engine_factory=None, **engine_kwargs) -> ServingEngine:
  """`mesh`: None (one device) or a jax Mesh whose dp groups each get a runner over their tp sub-mesh.
  `engine_factory(runner, strategy, **engine_kwargs)` builds one group's engine (default: `Engine`)."""
  from recguide_jax.parallel import data_parallel
  if engine_factory is None:
    from recguide_jax.engine.core import Engine as engine_factory
  # each group gets its own strategy object: a strategy's calibration and controller state is per group, and the
  # groups step concurrently
  engines = [engine_factory(r, strategy if i == 0 else data_parallel.strategy_copy(strategy), **engine_kwargs)
             for i, r in enumerate(data_parallel.build_runners(model, runner_config, mesh))]
  return engines[0] if len(engines) == 1 else data_parallel.DataParallelEngine(engines)
