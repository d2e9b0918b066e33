"""recguide-jax: a JAX/XLA serving engine for Nemotron-Labs-Diffusion models with RecGuide orchestration."""

from recguide_jax.model.config import ConfigError, NLDConfig
from recguide_jax.engine.requests import RequestError, SamplingParams

__version__ = "0.1.0"
__all__ = ["CompletionOutput", "ConfigError", "LLM", "NLDConfig", "RequestError", "RequestOutput", "SamplingParams"]

_LAZY = {"LLM", "CompletionOutput", "RequestOutput"}


def __getattr__(name: str):
  # the offline API loads jax and flax: only when asked for, so a script that imports a light submodule (flag
  # definitions, the mesh flags) answers --help and flag errors without them
  if name in _LAZY:
    from recguide_jax import llm
    return getattr(llm, name)
  raise AttributeError(f"module 'recguide_jax' has no attribute {name!r}")
