"""Rotary embeddings exactly as HF computes them for NLD: YaRN inverse frequencies, rotate-half layout, and the
Llama-4 query scale keyed by absolute position (docs/spec/nld.md §2.4 and §2.5)."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from recguide_jax.model.config import NLDConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@functools.lru_cache(maxsize=32)
def rope_tables(cfg: NLDConfig) -> tuple[np.ndarray, float]:
  """Returns (inv_freq [head_dim/2] float32, attention_factor) following transformers' rope utils."""
  dim = cfg.head_dim
  base = cfg.rope_theta
  # float32 arithmetic like torch, so the tables match the reference bit for bit.
  pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  inv_freq_extrap = (np.float32(1.0) / pos_freqs).astype(np.float32)
  if cfg.rope_type == "default":
    return inv_freq_extrap, 1.0
  factor = cfg.rope_factor
  inv_freq_interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
  if cfg.rope_attention_factor is not None:
    attention_factor = cfg.rope_attention_factor
  elif cfg.mscale and cfg.mscale_all_dim:
    attention_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
  else:
    attention_factor = _yarn_mscale(factor)

  def correction_dim(num_rotations: float) -> float:
    return (dim * math.log(cfg.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
        2 * math.log(base))

  low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # as HF: avoid a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
  extrap_factor = (1 - ramp).astype(np.float32)
  inv_freq = inv_freq_interp * (1 - extrap_factor) + inv_freq_extrap * extrap_factor
  return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray, attention_factor: float) -> jnp.ndarray:
  """x: [..., T, heads, D]; positions: [..., T] (absolute). Rotate-half (NeoX) layout, cos/sin in fp32 then cast to
  the activation dtype (HF order)."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  cos = (jnp.cos(emb) * attention_factor).astype(x.dtype)[..., None, :]
  sin = (jnp.sin(emb) * attention_factor).astype(x.dtype)[..., None, :]
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def llama4_query_scale(positions: jnp.ndarray, cfg: NLDConfig) -> jnp.ndarray:
  """`1 + beta * ln(1 + floor(p / original_max))`, per absolute position; identity below original_max."""
  p = positions.astype(jnp.float32)
  return 1.0 + cfg.llama_4_scaling_beta * jnp.log(1.0 + jnp.floor(p / cfg.original_max_position_embeddings))
