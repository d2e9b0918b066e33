"""NLD's joint AR + block-diffusion objective (docs/spec/nld.md §5), exactly:

- the doubled sequence [x_t | x_0] with positions arange(L) twice (the Llama-4 scale uses arange(2L));
- the "sbd_block_diff" mask: noisy queries see their own noisy block bidirectionally and the clean tokens of
  earlier blocks; clean queries are strictly causal over clean tokens;
- per-sequence masking rate p = (1 - eps) t + eps, t ~ U(0, 1), each position masked with probability p;
- loss = (w_dlm * sum_masked CE / p + w_ar * sum AR CE) / (num_masked + w_ar * num_AR_targets), summed over the
  whole batch before dividing (global averaging).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import causal_mask
from recguide_jax.model.nld import ForwardInputs

EPS = 1e-3
W_DLM = 0.3
W_AR = 1.0


def sbd_block_diff_mask(seq_len: int, block_size: int) -> np.ndarray:
  """Boolean [2L, 2L] allow-mask over [x_t | x_0]."""
  i = np.arange(2 * seq_len)
  noisy = i < seq_len
  blk = (i % seq_len) // block_size
  nq, nk = noisy[:, None], noisy[None, :]
  same_block = blk[:, None] == blk[None, :]
  earlier = blk[None, :] < blk[:, None]
  causal = i[None, :] <= i[:, None]
  return (nq & nk & same_block) | (nq & ~nk & earlier) | (~nq & ~nk & causal)


def noise(key: jax.Array, x0: jax.Array, mask_token_id: int, eps: float = EPS):
  """Returns (x_t, masked, p): per-sequence rate p = (1-eps) t + eps, iid Bernoulli(p) masking."""
  k_t, k_m = jax.random.split(key)
  b, n = x0.shape
  t = jax.random.uniform(k_t, (b,))
  p = (1 - eps) * t + eps
  masked = jax.random.uniform(k_m, (b, n)) < p[:, None]
  return jnp.where(masked, mask_token_id, x0), masked, p


def _ce(logits: jax.Array, targets: jax.Array) -> jax.Array:
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


def joint_loss(model, x0: jax.Array, key: jax.Array, block_size: int, mask_token_id: int,
               w_dlm: float = W_DLM, w_ar: float = W_AR):
  """The joint loss on a batch of clean sequences x0 [b, L]. Returns (loss, metrics)."""
  b, n = x0.shape
  xt, masked, p = noise(key, x0, mask_token_id)
  tokens = jnp.concatenate([xt, x0], axis=1)
  pos = jnp.arange(n)
  positions = jnp.broadcast_to(jnp.concatenate([pos, pos]), (b, 2 * n))
  inp = ForwardInputs(tokens=tokens, positions=positions, block_mask=None, train_block_size=block_size,
                      scale_positions=jnp.broadcast_to(jnp.arange(2 * n), (b, 2 * n)))
  logits, _ = model(inp)
  diff_ce = _ce(logits[:, :n], x0)  # unshifted: position i predicts x0[i]
  ar_ce = _ce(logits[:, n:-1], x0[:, 1:])  # shifted: position i predicts x0[i+1]
  diff_sum = jnp.sum(jnp.where(masked, diff_ce / p[:, None], 0.0))
  ar_sum = jnp.sum(ar_ce)
  n_masked = jnp.sum(masked)
  n_ar = b * (n - 1)
  loss = (w_dlm * diff_sum + w_ar * ar_sum) / (n_masked + w_ar * n_ar)
  metrics = {"loss": loss, "ar_ce": ar_sum / n_ar,
             "diff_ce": jnp.sum(jnp.where(masked, diff_ce, 0.0)) / jnp.maximum(n_masked, 1)}
  return loss, metrics


def ar_loss(model, x0: jax.Array):
  """Stage 1 (AR-only warm-up): plain next-token loss on a causal forward."""
  b, n = x0.shape
  inp = ForwardInputs(tokens=x0, positions=jnp.broadcast_to(jnp.arange(n), (b, n)),
                      block_mask=causal_mask(n))
  logits, _ = model(inp)
  ce = _ce(logits[:, :-1], x0[:, 1:])
  loss = jnp.mean(ce)
  return loss, {"loss": loss, "ar_ce": loss, "diff_ce": jnp.float32(0.0)}
