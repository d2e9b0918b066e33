"""The serving engine: `core` (the step loop and the services rounds use), `scheduler` (admission and grouping),
`prefill` (prompt chunks, prompt scoring, n samples sharing one prefill), `output` (emission and incremental stop
strings), `thread` (the engine on its own thread), `config` (the frozen `EngineConfig`), `protocol` (the
`ServingEngine` interface callers drive) and `build` (`build_engine`, one group or data-parallel groups). Request
types live in `recguide_jax.requests` and are re-exported here under their earlier import path
(`from recguide_jax.engine import SamplingParams`)."""

from recguide_jax.engine.build import build_engine
from recguide_jax.engine.config import EngineConfig
from recguide_jax.engine.core import Engine
from recguide_jax.engine.protocol import ServingEngine
from recguide_jax.engine.thread import EngineThread
from recguide_jax.requests import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                                   MAX_TOP_LOGPROBS, MIN_TEMPERATURE, SEED_RANGE, QueueFull, Request,
                                   RequestError, RequestStats, SamplingParams, SamplingRow, describe, fold_seed,
                                   sampling_row)

__all__ = [
    "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS", "MAX_TEMPERATURE", "MAX_TOP_LOGPROBS",
    "MIN_TEMPERATURE", "SEED_RANGE", "Engine", "EngineConfig", "EngineThread", "QueueFull", "Request",
    "RequestError", "RequestStats", "SamplingParams", "SamplingRow", "ServingEngine", "build_engine", "describe",
    "fold_seed", "sampling_row",
]
