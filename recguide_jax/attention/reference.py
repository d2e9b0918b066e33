"""Attention of a block of query tokens over a request's committed KV prefix plus the block itself.

Each request r brings Q query tokens. Every query sees the committed prefix [0, prefix_len[r]) (read from pages
through the page table) and the block's own keys through an intra-block boolean mask [Q, Q]: causal (verify,
prefill, AR), full (diffusion draft) or any tree layout (RecGuide's fused verify + branches). The pure-jnp
reference, `block_attention_ref`, and the masks (`causal_mask`, `full_mask`) live beside the Pallas kernels they
serve (`pallas_kernels.common`); this module adds the training attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import NEG_INF


def sbd_training_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int, scale: float,
                           in_block: np.ndarray | None = None) -> jax.Array:
  """Attention of the doubled training sequence [x_t | x_0] under the sbd_block_diff mask, without materialising
  the [2L, 2L] score matrix (half of it is always masked):
  - clean queries: causal over clean keys;
  - noisy queries: clean keys of earlier blocks plus the noisy keys of their own block (bidirectional, or as
    `in_block` [block, block] allows: a causal draft block).
  q: [b, 2L, Hq, D]; k, v: [b, 2L, Hkv, D]. Equal to `block_attention_ref` with `sbd_block_diff_mask`.
  """
  b, two_l, hq, d = q.shape
  n = two_l // 2
  hkv = k.shape[2]
  g = hq // hkv
  nb = n // block_size
  qf = q.reshape(b, two_l, hkv, g, d)
  q_noisy, q_clean = qf[:, :n], qf[:, n:]
  k_noisy, k_clean = k[:, :n], k[:, n:]
  v_noisy, v_clean = v[:, :n], v[:, n:]
  pos = jnp.arange(n)
  blk = pos // block_size

  def softmax_out(scores, values_fn):
    p = jax.nn.softmax(scores, axis=-1)
    return values_fn(p.astype(v.dtype))

  # clean stream: causal
  s_cc = jnp.einsum("bqhgd,bkhd->bhgqk", q_clean, k_clean, preferred_element_type=jnp.float32) * scale
  s_cc = jnp.where((pos[None, :] <= pos[:, None]), s_cc, NEG_INF)
  out_clean = softmax_out(s_cc, lambda p: jnp.einsum("bhgqk,bkhd->bqhgd", p, v_clean,
                                                     preferred_element_type=jnp.float32))
  # noisy stream: earlier clean blocks + own noisy block
  s_nc = jnp.einsum("bqhgd,bkhd->bhgqk", q_noisy, k_clean, preferred_element_type=jnp.float32) * scale
  s_nc = jnp.where(blk[None, :] < blk[:, None], s_nc, NEG_INF)
  qb = q_noisy.reshape(b, nb, block_size, hkv, g, d)
  kb = k_noisy.reshape(b, nb, block_size, hkv, d)
  vb = v_noisy.reshape(b, nb, block_size, hkv, d)
  s_nn = jnp.einsum("bnqhgd,bnkhd->bhgnqk", qb, kb, preferred_element_type=jnp.float32) * scale
  s_nn = s_nn.reshape(b, hkv, g, n, block_size)
  if in_block is not None and not in_block.all():
    s_nn = jnp.where(jnp.asarray(in_block)[pos % block_size], s_nn, NEG_INF)
  p = jax.nn.softmax(jnp.concatenate([s_nc, s_nn], axis=-1), axis=-1).astype(v.dtype)
  p_nc, p_nn = p[..., :n], p[..., n:].reshape(b, hkv, g, nb, block_size, block_size)
  out_noisy = (jnp.einsum("bhgqk,bkhd->bqhgd", p_nc, v_clean, preferred_element_type=jnp.float32) +
               jnp.einsum("bhgnqk,bnkhd->bnqhgd", p_nn, vb,
                          preferred_element_type=jnp.float32).reshape(b, n, hkv, g, d))
  out = jnp.concatenate([out_noisy, out_clean], axis=1)
  return out.reshape(b, two_l, hq, d).astype(q.dtype)
