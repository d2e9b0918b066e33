"""Block-diffusion attention over the paged KV cache: TPU kernel (Pallas Mosaic).

Grid (request r, prefix step i), semantics ("parallel", "arbitrary"). The page table (flattened [b * P]) and the
prefix lengths [b] are scalar-prefetched into SMEM, so the BlockSpec index maps can follow the page table: a step
loads `ppb` pages (all KV heads: the cache's [page_size, Hkv * D] layout, in which a head is a lane-aligned column
block)
through `ppb` page inputs whose index map is `page_table[r, min(i * ppb + j, last_page[r])]`. Clamping to the
request's last page makes the steps past its ragged length re-use the block already in VMEM (the pipeline skips a
copy whose block index did not change) and `pl.when` skips their compute, so a short request in a long-padded batch
costs neither bandwidth nor MXU time.

Per request all GQA-folded query rows (see `common`) stay in VMEM for the whole walk, with fp32 scratch for the
running max, denominator and accumulator per KV head:
  step 0          initialise from the block's own keys under the intra-block mask (the diagonal is always visible,
                  so every real row starts from a finite max),
  prefix steps    online-softmax update with the step's pages, positions >= prefix_len masked,
  last step       write acc / l.
Mosaic wants the last two block dims divisible by (8, 128) or equal to the array's, hence whole pages (all heads)
and tokens padded to a multiple of 8; page_size should be a multiple of 8 (16 for bf16) so the pages of a step stack
on sublanes, and head_dim a multiple of 128 keeps the per-head column slices free.

Stacked pages [L, N, ...] with `layer`: the cache is viewed as [L * N, ...] and the prefetched page ids carry the
layer's offset, so the index maps DMA that layer's pages straight from the stacked array (no per-layer slice).

No split-K here (unlike the GPU kernel): a TensorCore runs the grid sequentially, so extra programs only help on
chips with two cores per device (megacore), where the "parallel" request axis already feeds both once b >= 2, and
the prefix walk is a double-buffered DMA stream that is bandwidth-bound on its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.common import NEG_INF


def _kernel(pt_ref, plen_ref, *refs, mask_kind: str, nq: int, qp: int, ppb: int, scale: float, precision):
  del pt_ref  # only the index maps read the page table
  q_ref, kb_ref, vb_ref = refs[:3]
  refs = refs[3:]
  if mask_kind == "tree":
    words_ref, refs = refs[0], refs[1:]
  k_refs, v_refs = refs[:ppb], refs[ppb:2 * ppb]
  o_ref, m_ref, l_ref, acc_ref = refs[2 * ppb:]
  hkv, rows, d = q_ref.shape
  page_size = k_refs[0].shape[0]
  r, i = pl.program_id(0), pl.program_id(1)
  dims = (((1,), (1,)), ((), ()))  # q @ k.T

  @pl.when(i == 0)
  def _block():
    kp = kb_ref.shape[1]
    cols = jax.lax.broadcasted_iota(jnp.int32, (rows, kp), 1)
    if mask_kind == "tree":
      visible = common.unpack_mask_bits([words_ref[:, w:w + 1] for w in range(words_ref.shape[1])], cols)
    else:
      visible = cols < nq
      if mask_kind == "causal":
        # qp is a power of two here: the row's token is a mask, not a vector remainder
        visible = visible & (cols <= (jax.lax.broadcasted_iota(jnp.int32, (rows, kp), 0) & (qp - 1)))
    for h in range(hkv):
      q = q_ref[h]
      s = jax.lax.dot_general(q, kb_ref[h].astype(q.dtype), dims, precision=precision,
                              preferred_element_type=jnp.float32) * scale
      s = jnp.where(visible, s, NEG_INF)
      m = jnp.max(s, axis=1, keepdims=True)
      p = jnp.where(visible, jnp.exp(s - m), 0.0)
      m_ref[h] = m
      l_ref[h] = jnp.sum(p, axis=1, keepdims=True)
      vb = vb_ref[h]
      acc_ref[h] = jnp.dot(p.astype(vb.dtype), vb, precision=precision, preferred_element_type=jnp.float32)

  prefix_len = plen_ref[r]
  start = i * (ppb * page_size)

  @pl.when(start < prefix_len)
  def _prefix():
    pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, ppb * page_size), 1)
    valid = pos < prefix_len
    for h in range(hkv):
      q = q_ref[h]
      heads = pl.ds(h * d, d)  # lane-aligned for head_dim 128: a plain [page_size, D] tile load
      k = jnp.concatenate([k_refs[j][:, heads] for j in range(ppb)], axis=0).astype(q.dtype)
      v = jnp.concatenate([v_refs[j][:, heads] for j in range(ppb)], axis=0).astype(vb_ref.dtype)
      s = jax.lax.dot_general(q, k, dims, precision=precision, preferred_element_type=jnp.float32) * scale
      s = jnp.where(valid, s, NEG_INF)
      m_prev = m_ref[h]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      alpha = jnp.exp(m_prev - m_new)
      p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
      m_ref[h] = m_new
      l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
      acc_ref[h] = alpha * acc_ref[h] + jnp.dot(p.astype(v.dtype), v, precision=precision,
                                                preferred_element_type=jnp.float32)

  @pl.when(i == pl.num_programs(1) - 1)
  def _out():
    for h in range(hkv):
      l = l_ref[h]
      o_ref[h] = (acc_ref[h] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)  # l = 0: padding rows only


@functools.partial(jax.jit, static_argnames=("mask_kind", "scale", "interpret", "block_sizes"))
def _attention(q, k_block, v_block, tree_mask, k_pages, v_pages, page_table, prefix_len, layer=None, *, mask_kind,
               scale, interpret, block_sizes):
  b, nq, hq, d = q.shape
  hkv = k_block.shape[2]
  g = hq // hkv
  page_size = common.layer_pages(k_pages, layer)[1]
  k_pages, offset = common.layer_view(k_pages, layer)
  v_pages, _ = common.layer_view(v_pages, layer)
  qp = common.round_up(nq, 8)
  if mask_kind == "causal":  # the kernel derives a row's token as row & (qp - 1); blocks are 2^k tokens anyway
    qp = common.next_pow2(qp)
  rows = g * qp
  bs = block_sizes or common.pick_block_sizes(common.TPU_BLOCK_TABLE, rows)
  ppb = max(1, min(bs.block_k // page_size, page_table.shape[1]))  # no more pages per step than a row has
  width = common.round_up(page_table.shape[1], ppb)
  pt = (jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - page_table.shape[1]))) + offset).reshape(-1)
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  qf = common.fold_queries(q, hkv, qp, g, rows)
  inputs = [qf, common.fold_block_kv(k_block, qp), common.fold_block_kv(v_block, qp)]
  per_request = lambda shape: pl.BlockSpec((None,) + shape, lambda r, i, pt, plen: (r,) + (0,) * len(shape))
  in_specs = [per_request((hkv, rows, d)), per_request((hkv, qp, d)), per_request((hkv, qp, d))]
  if mask_kind == "tree":
    words = common.pack_mask_rows(tree_mask, qp, g, rows, qp, word_major=False)
    inputs.append(words)
    in_specs.append(per_request(words.shape[1:]))

  def page_map(j):
    def index_map(r, i, pt, plen):
      last = jnp.maximum(jax.lax.div(plen[r] + page_size - 1, page_size) - 1, 0)  # non-negative: no floor fix-up
      return pt[r * width + jnp.minimum(i * ppb + j, last)], 0, 0
    return pl.BlockSpec((None, page_size, hkv * d), index_map)

  # the pages as they lie ([N, ps, Hkv * D], head h on lanes [h * D, (h + 1) * D)): no relayout before the call
  inputs += [k_pages] * ppb + [v_pages] * ppb
  in_specs += [page_map(j) for j in range(ppb)] * 2
  kernel = functools.partial(_kernel, mask_kind=mask_kind, nq=nq, qp=qp, ppb=ppb, scale=scale, precision=precision)
  out = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, width // ppb),
      in_specs=in_specs,
      out_specs=per_request((hkv, rows, d)),
      scratch_shapes=[pltpu.VMEM((hkv, rows, 1), jnp.float32), pltpu.VMEM((hkv, rows, 1), jnp.float32),
                      pltpu.VMEM((hkv, rows, d), jnp.float32)]),
    out_shape=jax.ShapeDtypeStruct(qf.shape, q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
    name=f"block_attention_{mask_kind}",
  )(pt, prefix_len.astype(jnp.int32), *inputs)
  return common.unfold_out(out, nq, hq, qp, g)


def block_attention(q: jax.Array, k_block: jax.Array, v_block: jax.Array, block_mask, *,
                    k_pages: jax.Array | None = None, v_pages: jax.Array | None = None,
                    page_table: jax.Array | None = None, prefix_len: jax.Array | None = None, scale: float,
                    layer: int | jax.Array | None = None, interpret=False,
                    block_sizes: common.BlockSizes | None = None):
  """Same contract as `block_attention_ref`; `block_mask` may also be "causal" or "full". Arguments as the GPU
  kernel's (`block_attention_gpu.block_attention`, without `num_splits`): k_pages/v_pages [num_pages, page_size, Hkv,
  D] with the heads folded, [num_pages, page_size, Hkv * D], or stacked [L, num_pages, page_size, Hkv * D] read in
  place at `layer` (int or int32 scalar).

  `interpret`: False on TPU; True (generic interpreter) or a `pltpu.InterpretParams` (TPU-semantics interpreter)
  to run on CPU. Without page_table the prefix is empty. Returns [b, Q, Hq, D] in q's dtype.
  """
  return common.run_block_attention(
      _attention, 8, q, k_block, v_block, block_mask, k_pages=k_pages, v_pages=v_pages,
      page_table=page_table, prefix_len=prefix_len, scale=scale, interpret=interpret,
      block_sizes=block_sizes, layer=layer)


block_attention_ref = common.block_attention_ref  # the twin: one pure-jnp reference serves both backends
