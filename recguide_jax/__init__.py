"""recguide-jax: a JAX/XLA serving engine for Nemotron-Labs-Diffusion models with RecGuide orchestration."""

from recguide_jax.config import ConfigError, NLDConfig

__all__ = ["ConfigError", "NLDConfig"]
__version__ = "0.1.0"

from recguide_jax.engine import RequestError, SamplingParams  # noqa: E402
from recguide_jax.llm import LLM, CompletionOutput, RequestOutput  # noqa: E402

__all__ += ["CompletionOutput", "LLM", "RequestError", "RequestOutput", "SamplingParams"]
