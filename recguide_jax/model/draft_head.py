"""How a draft forward reads a block, per the model's `DraftHead` (model/config.py): which in-block tokens a draft
query sees, which tokens the draft adapter is on for, and which position's hidden state drafts each token.

Every draft path (the engine's draft, ragged draft, denoise and RecGuide's fused tree, and the distillation
objective) goes through these, so a model drafts in serving exactly as it was trained to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import causal_mask
from recguide_jax.model.config import DraftHead


def block_mask(head: DraftHead, size: int) -> np.ndarray:
  """[size, size] bool (row = query): which tokens of its own draft block a draft query sees."""
  return causal_mask(size) if head is DraftHead.NEXT_POSITION else np.ones((size, size), bool)


def adapter_rows(head: DraftHead, tokens, mask_token_id: int):
  """Where the draft adapter is on in a draft block (numpy or jax, like `tokens`): every token (NLD), or the mask
  tokens only (an AR head: its clean seed then predicts exactly as the verifier does)."""
  xp = jnp if isinstance(tokens, jax.Array) else np
  return xp.ones(tokens.shape, bool) if head is DraftHead.SAME_POSITION else tokens == mask_token_id


def align(head: DraftHead, h: jax.Array, block: int) -> jax.Array:
  """Hidden states [..., T, H] of draft blocks of `block` tokens (T a multiple of it) moved so that index i holds
  the state that drafts token i: itself (NLD), or index i - 1 of the same block (an AR head; index 0, a block's
  seed or guessed bonus, keeps its own and is never read as a draft)."""
  if head is DraftHead.SAME_POSITION:
    return h
  *lead, t, hidden = h.shape
  blocks = h.reshape(*lead, t // block, block, hidden)
  return jnp.concatenate([blocks[..., :1, :], blocks[..., :-1, :]], axis=-2).reshape(h.shape)
