"""The device side: step functions over the model state and the paged KV cache, the runner that compiles and
runs them keyed by a frozen `StepKey`, and the compile bookkeeping. It knows nothing of decoding strategies."""

from recguide_jax.runtime.compilation import BackgroundCompiler, CompileCounter, enable_compile_cache
from recguide_jax.runtime.runner import (MAX_COMPILE_WORKERS, Runner, RunnerConfig, VerifyResult, fused_kind,
                                         fused_slots)
from recguide_jax.runtime.step_key import BLOCK_SIZES, StepKey, StepKind, batch_buckets
from recguide_jax.runtime.steps import SamplingArrays, StepFunctions
from recguide_jax.runtime.uncertainty import draft_signals, verifier_entropy

__all__ = [
  "BLOCK_SIZES", "BackgroundCompiler", "CompileCounter", "MAX_COMPILE_WORKERS", "Runner", "RunnerConfig",
  "SamplingArrays", "StepFunctions", "StepKey", "StepKind", "VerifyResult", "batch_buckets", "draft_signals",
  "enable_compile_cache", "fused_kind", "fused_slots", "verifier_entropy",
]
