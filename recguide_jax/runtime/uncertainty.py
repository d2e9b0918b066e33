"""Per-position uncertainty of a step's distributions, computed on the device so only [b, B]-sized results cross
to the host: what a decoding strategy reads to size its next draft (docs/spec/recguide.md §4.1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recguide_jax.runtime import sampling


def draft_signals(logits: jax.Array, drafted: jax.Array, cfg) -> jax.Array:
  """Draft uncertainty per position from the raw draft distribution with the mask token excluded (EOS stays):
  confidence p(top1), margin p(top1) - p(top2), and the runner-up ("alternative") token: the most likely token
  other than the drafted one, the mask and EOS (-1 when there is none). Returns float32 [b, 3, B]."""
  probs = jax.nn.softmax(sampling.exclude_token(logits.astype(jnp.float32), cfg.mask_token_id), axis=-1)
  top2, _ = sampling.top_n(probs, 2)
  conf, margin = top2[..., 0], top2[..., 0] - top2[..., 1]
  excl = probs.at[..., cfg.mask_token_id].set(-1.0)
  for e in cfg.eos_token_ids:
    excl = excl.at[..., e].set(-1.0)
  excl = jnp.where(jax.nn.one_hot(drafted, probs.shape[-1], dtype=bool), -1.0, excl)
  alt = sampling.argmax(excl)
  alt = jnp.where(jnp.max(excl, axis=-1) > 0, alt, -1)
  return jnp.stack([conf, margin, alt.astype(jnp.float32)], axis=1)


def verifier_entropy(logits: jax.Array, cfg) -> jax.Array:
  """Entropy (nats) of the verifier's distribution per position, mask token excluded: [b, B]."""
  lp = jax.nn.log_softmax(sampling.exclude_token(logits.astype(jnp.float32), cfg.mask_token_id), axis=-1)
  return -jnp.sum(jnp.where(jnp.isfinite(lp), jnp.exp(lp) * lp, 0.0), axis=-1)
