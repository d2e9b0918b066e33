"""Block attention over the paged prefix whose cost follows the live context, not `max_model_len`: the XLA path
the model takes when no Pallas kernel does (the CPU, and accelerators whose shapes the kernels refuse).

`attention.block_attention_ref` gathers every page of the page table, i.e. `max_model_len` tokens for every row of
every step, whatever the rows' real lengths. Here the prefix is read in chunks of `CHUNK_TOKENS` with an online
(flash-style) softmax, and the loop runs only as many chunks as the longest live prefix of the batch needs (a
`while_loop` with a data-dependent trip count): one compiled variant serves every context length, so start-up
compiles nothing extra, and a step's attention reads ceil(max prefix / chunk) chunks. Same contract and result as
`block_attention_ref` (up to float summation order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recguide_jax.kv_cache import TRASH_PAGE, gather_prefix

NEG_INF = -1e30  # finite, as in attention.py: a fully masked chunk contributes exp(-1e30 - m) = 0, never NaN
CHUNK_TOKENS = 256  # prefix tokens per loop iteration (rounded to whole pages)


def chunk_pages(page_size: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
  return max(1, chunk_tokens // page_size)


def block_attention(q: jax.Array, k_block: jax.Array, v_block: jax.Array, block_mask: jax.Array, *,
                    k_pages: jax.Array | None = None, v_pages: jax.Array | None = None,
                    page_table: jax.Array | None = None, prefix_len: jax.Array | None = None,
                    scale: float, layer: jax.Array | int | None = None,
                    chunk_tokens: int = CHUNK_TOKENS) -> jax.Array:
  """`attention.block_attention_ref`'s contract: q [b, Q, Hq, D], k_block/v_block [b, Q, Hkv, D], block_mask
  [b, Q, Q] or [Q, Q]; optional prefix k_pages/v_pages ([num_pages, page_size, Hkv, D], or every layer's
  [L, ...] read at `layer`), page_table [b, P], prefix_len [b]. Returns [b, Q, Hq, D] in q's dtype; fp32 softmax."""
  b, nq, hq, d = q.shape
  hkv = k_block.shape[2]
  g = hq // hkv
  qf = q.reshape(b, nq, hkv, g, d)
  if block_mask.ndim == 2:
    block_mask = jnp.broadcast_to(block_mask, (b, nq, nq))
  # the block's own keys first: they seed the running max, sum and output of the online softmax
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k_block, preferred_element_type=jnp.float32) * scale
  s = jnp.where(block_mask[:, None, None], s, NEG_INF)
  m = jnp.max(s, axis=-1)  # [b, hkv, g, Q]
  p = jnp.exp(s - m[..., None])
  denom = jnp.sum(p, axis=-1)
  acc = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v_block.dtype), v_block, preferred_element_type=jnp.float32)

  if page_table is not None:
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
    page_size = k_pages.shape[-3]
    per_chunk = chunk_pages(page_size, chunk_tokens)
    width = page_table.shape[1]
    padded = -(-width // per_chunk) * per_chunk
    if padded != width:  # whole chunks only; the extra columns point at the trash page and are masked below
      page_table = jnp.pad(page_table, ((0, 0), (0, padded - width)), constant_values=TRASH_PAGE)
    chunk_len = per_chunk * page_size
    live = jnp.minimum(jnp.max(prefix_len), width * page_size)
    num_chunks = (live + chunk_len - 1) // chunk_len

    def body(i, carry):
      m, denom, acc = carry
      pages = jax.lax.dynamic_slice_in_dim(page_table, i * per_chunk, per_chunk, axis=1)
      k = gather_prefix(k_pages, pages, layer, k_block.dtype).astype(q.dtype)
      v = gather_prefix(v_pages, pages, layer, v_block.dtype).astype(v_block.dtype)
      sc = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k, preferred_element_type=jnp.float32) * scale
      pos = i * chunk_len + jnp.arange(chunk_len)
      sc = jnp.where((pos[None, :] < prefix_len[:, None])[:, None, None, None, :], sc, NEG_INF)
      m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(sc - m_new[..., None])
      denom = denom * alpha + jnp.sum(p, axis=-1)
      acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v,
                                                preferred_element_type=jnp.float32)
      return m_new, denom, acc

    m, denom, acc = jax.lax.fori_loop(0, num_chunks, body, (m, denom, acc))

  out = acc / denom[..., None]  # [b, hkv, g, Q, D]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, nq, hq, d).astype(q.dtype)
