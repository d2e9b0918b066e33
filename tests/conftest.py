"""Shared fixtures: tiny random NLD models and engines built once per test session (compiling step variants is
the slow part on CPU, so tests reuse runners and compile lazily)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from flax import nnx  # noqa: E402

from recguide_jax.config import NLDConfig  # noqa: E402
from recguide_jax.model import NLDModel  # noqa: E402


def tiny_config(**overrides) -> NLDConfig:
  base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, mask_token_id=3, bos_token_id=1, eos_token_ids=(2,),
              original_max_position_embeddings=64, rope_factor=4.0, block_size=8)
  base.update(overrides)
  return NLDConfig(**base)


@pytest.fixture(scope="session")
def tiny_model() -> NLDModel:
  return NLDModel(tiny_config(), rngs=nnx.Rngs(7))


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
  """One LLM (runner + engine) over the tiny model for all engine tests; variants compile on first use."""
  from recguide_jax import LLM
  return LLM(model=tiny_model, policy="ar", max_batch=8, max_model_len=256, page_size=8, prefill_chunk=16,
             block_sizes=(8, 16, 32), warmup=False, compile_cache_dir=None)
