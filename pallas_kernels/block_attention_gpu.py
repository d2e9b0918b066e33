"""Block-diffusion attention over the paged KV cache: GPU kernel (Pallas Triton backend).

Backend: `jax.experimental.pallas.triton`. Mosaic GPU is Pallas's default GPU backend since jax 0.9, but it is
built around TMA copies of rectangular tiles and warpgroup matmuls; this kernel's inner loop is a gather of pages
through the page table (`k_ref[page_ids]`), which the Triton lowering turns into a pointer gather, and its masks are
elementwise iota arithmetic, both of which Triton lowers directly and the generic interpreter runs on CPU.

Grid (request r, KV head h, row block i). Each program owns `block_r` GQA-folded query rows (see `common`) and:
  1. scores them against the block's own keys under the intra-block mask (causal / full: iota; tree: packed bits),
  2. walks the committed prefix [0, prefix_len[r]) `block_k` keys (= block_k / page_size pages) at a time, loading
     the page ids from the request's page-table row and gathering those pages for head h, masking the tail,
  3. keeps an online softmax (running max, denominator, fp32 accumulator) and writes acc / l once.
Starting with the block means every real row has a finite running max before the first prefix step (the diagonal is
always visible), and a request with prefix_len 0 runs zero prefix steps.

Triton needs power-of-two tensors and matmul dims >= 16, so Q is padded to Qp = next_pow2(Q), the block keys to
max(16, Qp), the group to a power of two and the rows to >= 16; head_dim and page_size must be powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels import kv_write_gpu as kv_write
from pallas_kernels.common import NEG_INF


def _kernel(*refs, mask_kind: str, nq: int, qp: int, block_r: int, ppb: int, scale: float, precision):
  if mask_kind == "tree":
    q_ref, kb_ref, vb_ref, words_ref, pt_ref, plen_ref, k_ref, v_ref, o_ref = refs
  else:
    q_ref, kb_ref, vb_ref, pt_ref, plen_ref, k_ref, v_ref, o_ref = refs
  page_size, d = k_ref.shape[1], k_ref.shape[2]
  block_k = ppb * page_size
  q = q_ref[...]  # [block_r, D]
  rows = pl.program_id(2) * block_r + jnp.arange(block_r, dtype=jnp.int32)

  # 1. the block's own keys
  kb = kb_ref[...]
  s = plgpu.dot(q, kb.astype(q.dtype), trans_b=True, precision=precision).astype(jnp.float32) * scale
  cols = jnp.broadcast_to(jnp.arange(kb.shape[0], dtype=jnp.int32)[None, :], s.shape)
  if mask_kind == "tree":
    visible = common.unpack_mask_bits([words_ref[w, :][:, None] for w in range(words_ref.shape[0])], cols)
  else:
    visible = cols < nq
    if mask_kind == "causal":
      visible = visible & (cols <= (rows & (qp - 1))[:, None])  # qp is a power of two
  s = jnp.where(visible, s, NEG_INF)
  m = jnp.max(s, axis=1)
  p = jnp.where(visible, jnp.exp(s - m[:, None]), 0.0)
  l = jnp.sum(p, axis=1)
  vb = vb_ref[...]
  acc = plgpu.dot(p.astype(vb.dtype), vb, precision=precision).astype(jnp.float32)

  # 2. the committed prefix, block_k keys per step
  prefix_len = plen_ref[0]

  def step(c, carry):
    acc, m, l = carry
    page_ids = pt_ref[pl.ds(c * ppb, ppb)]
    k = k_ref[page_ids].reshape(block_k, d).astype(q.dtype)
    v = v_ref[page_ids].reshape(block_k, d).astype(vb.dtype)
    s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32) * scale
    valid = (c * block_k + jnp.arange(block_k, dtype=jnp.int32))[None, :] < prefix_len
    s = jnp.where(valid, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision).astype(jnp.float32)
    return acc, m_new, l

  acc, m, l = jax.lax.fori_loop(0, pl.cdiv(prefix_len, block_k), step, (acc, m, l))
  # 3. normalise; rows that saw no key at all (padding) have l = 0
  o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("mask_kind", "scale", "interpret", "block_sizes"))
def _attention(q, k_block, v_block, tree_mask, k_pages, v_pages, page_table, prefix_len, *, mask_kind, scale,
               interpret, block_sizes):
  b, nq, hq, d = q.shape
  hkv = k_block.shape[2]
  g = hq // hkv
  page_size = k_pages.shape[1]
  qp, gp = common.next_pow2(nq), common.next_pow2(g)
  kp = max(16, qp)
  rows = max(16, gp * qp)
  bs = block_sizes or common.pick_block_sizes(common.GPU_BLOCK_TABLE, rows)
  block_r = min(bs.block_r, rows)
  ppb = max(1, bs.block_k // page_size)
  pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, common.round_up(page_table.shape[1], ppb) -
                                                       page_table.shape[1])))
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  qf = common.fold_queries(q, hkv, qp, gp, rows)
  inputs = [qf, common.fold_block_kv(k_block, kp), common.fold_block_kv(v_block, kp)]
  in_specs = [pl.BlockSpec((None, None, block_r, d), lambda r, h, i: (r, h, i, 0)),
              pl.BlockSpec((None, None, kp, d), lambda r, h, i: (r, h, 0, 0)),
              pl.BlockSpec((None, None, kp, d), lambda r, h, i: (r, h, 0, 0))]
  if mask_kind == "tree":
    words = common.pack_mask_rows(tree_mask, qp, gp, rows, kp, word_major=True)
    inputs.append(words)
    in_specs.append(pl.BlockSpec((None, words.shape[1], block_r), lambda r, h, i: (r, 0, i)))
  inputs += [pt, prefix_len.astype(jnp.int32)[:, None], k_pages, v_pages]
  pages_spec = pl.BlockSpec((k_pages.shape[0], page_size, None, d), lambda r, h, i: (0, 0, h, 0))
  in_specs += [pl.BlockSpec((None, pt.shape[1]), lambda r, h, i: (r, 0)),
               pl.BlockSpec((None, 1), lambda r, h, i: (r, 0)), pages_spec, pages_spec]

  kernel = functools.partial(_kernel, mask_kind=mask_kind, nq=nq, qp=qp, block_r=block_r, ppb=ppb, scale=scale,
                             precision=precision)
  out = pl.pallas_call(
    kernel,
    grid=(b, hkv, rows // block_r),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((None, None, block_r, d), lambda r, h, i: (r, h, i, 0)),
    out_shape=jax.ShapeDtypeStruct(qf.shape, q.dtype),
    compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
    interpret=interpret,
    name=f"block_attention_{mask_kind}",
  )(*inputs)
  return common.unfold_out(out, nq, hq, qp, gp)


def block_attention(q: jax.Array, k_block: jax.Array, v_block: jax.Array, block_mask, *,
                    k_pages: jax.Array | None = None, v_pages: jax.Array | None = None,
                    page_table: jax.Array | None = None, prefix_len: jax.Array | None = None, scale: float,
                    write_positions: jax.Array | None = None, write: jax.Array | None = None,
                    interpret: bool = False, block_sizes: common.BlockSizes | None = None):
  """Same contract as `recguide_jax.attention.block_attention_ref`; `block_mask` may also be "causal" or "full".

  q: [b, Q, Hq, D] (already carrying the Llama-4 scale); k_block/v_block: [b, Q, Hkv, D]; block_mask: [b, Q, Q] /
  [Q, Q] bool or a kind; k_pages/v_pages: [num_pages, page_size, Hkv, D]; page_table: [b, P]; prefix_len: [b].
  Without page_table the prefix is empty. Returns [b, Q, Hq, D] in q's dtype, or with `write_positions` ([b, Q];
  `write` [b, Q] bool, default all) also runs the fused write (`kv_write_gpu`, same cache as `kv_cache.write_block`)
  after the attention and returns (out, k_pages, v_pages); the pages passed in are donated then.
  """
  return common.run_block_attention(
      _attention, kv_write.kv_write, 16, q, k_block, v_block, block_mask, k_pages=k_pages, v_pages=v_pages,
      page_table=page_table, prefix_len=prefix_len, scale=scale, write_positions=write_positions, write=write,
      interpret=interpret, block_sizes=block_sizes)


block_attention_ref = common.block_attention_ref
