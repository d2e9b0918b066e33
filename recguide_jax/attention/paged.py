"""Block attention over the paged prefix whose cost follows the live context, not `max_model_len`: the XLA path
the model takes when no Pallas kernel does (the CPU, and accelerators whose shapes the kernels refuse).

`block_attention_ref` (pallas_kernels.common) gathers every page of the page table, i.e. `max_model_len` tokens for every row of
every step, whatever the rows' real lengths. Here the prefix is read in chunks with an online (flash-style)
softmax, and the loops run only as many chunks as the longest live prefix of the batch needs (`while_loop`s with
data-dependent trip counts): one compiled variant serves every context length, so start-up compiles nothing extra.
Whole chunks of `CHUNK_TOKENS` come first, then the rest in tail chunks of `TAIL_CHUNK_TOKENS`, so a step reads
less than one tail chunk past the longest live prefix (a 130-token context reads 160 tokens, not 256). Same
contract and result as `block_attention_ref` (up to float summation order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import NEG_INF  # finite: a fully masked chunk contributes exp(NEG_INF - m) = 0, never NaN
from recguide_jax.cache.kv_cache import TRASH_PAGE, gather_prefix
CHUNK_TOKENS = 256  # prefix tokens per iteration of the whole-chunk loop (rounded to whole pages)
TAIL_CHUNK_TOKENS = 32  # prefix tokens per iteration of the tail loop (whole pages dividing a whole chunk)


def chunk_pages(page_size: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
  return max(1, chunk_tokens // page_size)


def tail_chunk_pages(per_chunk: int, page_size: int, tail_tokens: int = TAIL_CHUNK_TOKENS) -> int:
  """Pages per tail chunk: the largest divisor of a whole chunk's `per_chunk` pages within `tail_tokens` (at least
  one page), so the tail loop's slices stay inside a table padded to whole chunks."""
  limit = max(1, tail_tokens // page_size)
  return max(d for d in range(1, per_chunk + 1) if per_chunk % d == 0 and d <= limit)


def block_attention(q: jax.Array, k_block: jax.Array, v_block: jax.Array, block_mask: jax.Array, *,
                    k_pages: jax.Array | None = None, v_pages: jax.Array | None = None,
                    page_table: jax.Array | None = None, prefix_len: jax.Array | None = None,
                    scale: float, layer: jax.Array | int | None = None,
                    chunk_tokens: int = CHUNK_TOKENS, tail_chunk_tokens: int = TAIL_CHUNK_TOKENS) -> jax.Array:
  """`attention.block_attention_ref`'s contract: q [b, Q, Hq, D], k_block/v_block [b, Q, Hkv, D], block_mask
  [b, Q, Q] or [Q, Q]; optional prefix k_pages/v_pages ([num_pages, page_size, Hkv * D], or every layer's
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
    page_size = k_pages.shape[-2]
    per_chunk = chunk_pages(page_size, chunk_tokens)
    per_tail = tail_chunk_pages(per_chunk, page_size, tail_chunk_tokens)
    width = page_table.shape[1]
    padded = -(-width // per_chunk) * per_chunk
    if padded != width:  # whole chunks only; the extra columns point at the trash page and are masked below
      page_table = jnp.pad(page_table, ((0, 0), (0, padded - width)), constant_values=TRASH_PAGE)
    live = jnp.minimum(jnp.max(prefix_len), width * page_size)

    def attend(first_page, pages_per_iter):
      """The loop body over chunks of `pages_per_iter` pages from table column `first_page` on."""
      chunk_len = pages_per_iter * page_size

      def body(i, carry):
        m, denom, acc = carry
        start = first_page + i * pages_per_iter
        pages = jax.lax.dynamic_slice_in_dim(page_table, start, pages_per_iter, axis=1)
        k = gather_prefix(k_pages, pages, layer, k_block.dtype, kv_heads=hkv).astype(q.dtype)
        v = gather_prefix(v_pages, pages, layer, v_block.dtype, kv_heads=hkv).astype(v_block.dtype)
        sc = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k, preferred_element_type=jnp.float32) * scale
        pos = start * page_size + jnp.arange(chunk_len)
        sc = jnp.where((pos[None, :] < prefix_len[:, None])[:, None, None, None, :], sc, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[..., None])
        denom = denom * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
        return m_new, denom, acc

      return body

    # whole chunks, then tail chunks up to the longest live prefix (per_tail divides per_chunk, so the tail's
    # slices end inside the padded table)
    whole = live // (per_chunk * page_size)
    carry = jax.lax.fori_loop(0, whole, attend(0, per_chunk), (m, denom, acc))
    rest = live - whole * per_chunk * page_size
    tail_len = per_tail * page_size
    m, denom, acc = jax.lax.fori_loop(0, (rest + tail_len - 1) // tail_len, attend(whole * per_chunk, per_tail),
                                      carry)

  out = acc / denom[..., None]  # [b, hkv, g, Q, D]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, nq, hq, d).astype(q.dtype)
