"""Block-diffusion attention over the paged KV cache: GPU kernel (Pallas Triton backend), split-K over the prefix.

Backend: `jax.experimental.pallas.triton`. Mosaic GPU is Pallas's default GPU backend since jax 0.9, but it is
built around TMA copies of rectangular tiles and warpgroup matmuls; this kernel's inner loop is a gather of pages
through the page table (`k_ref[page_ids]`), which the Triton lowering turns into a pointer gather, and its masks are
elementwise iota arithmetic, both of which Triton lowers directly and the generic interpreter runs on CPU.

Grid (request r, KV head h, row block i, prefix split s). Each program owns `block_r` GQA-folded query rows (see
`common`) and one split of the page table ([s * steps, (s + 1) * steps) steps of `block_k` keys):
  1. split 0 scores the rows against the block's own keys under the intra-block mask (causal / full: iota; tree:
     packed bits); other splits start empty,
  2. walks its part of the committed prefix [0, prefix_len[r]) `block_k` keys (= block_k / page_size pages) at a
     time, loading the page ids from the request's page-table row and gathering those pages for head h, masking the
     tail; the loop bound is the request's own length, so a split past it does no work,
  3. keeps an online softmax (running max m, denominator l, fp32 accumulator). With one split it writes acc / l;
     with several it writes (acc, m, l) and `combine_splits` merges them by log-sum-exp outside the kernel
     (flash-decoding). The split count is static, from the page-table width and the grid size
     (`common.gpu_num_splits`, see docs/kernels.md), so that one long request still fills the GPU.
Starting with the block means every real row of split 0 has a finite running max before its first prefix step (the
diagonal is always visible); the other splits start from m = -1e30, l = 0, which the first valid key replaces.

Triton needs power-of-two tensors and matmul dims >= 16, so Q is padded to Qp = next_pow2(Q), the block keys to
max(16, Qp), the group to a power of two and the rows to >= 16; head_dim and page_size must be powers of two.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.common import NEG_INF


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
  """The static shape of one call: padded sizes, block sizes and the prefix split."""
  qp: int  # query tokens padded to a power of two
  gp: int  # GQA group padded to a power of two
  kp: int  # block keys (>= 16)
  rows: int  # folded rows per (request, KV head)
  block_r: int
  ppb: int  # pages per prefix step (block_k = ppb * page_size)
  splits: int  # grid programs along the prefix
  steps_per_split: int  # block_k steps each split walks (the last may run past the table: masked)
  block_sizes: common.BlockSizes

  @property
  def programs(self) -> int:
    """Programs per (request, KV head), splits included."""
    return self.rows // self.block_r * self.splits


def launch_plan(b: int, nq: int, hq: int, hkv: int, page_size: int, table_width: int,
                block_sizes: common.BlockSizes | None = None, num_splits: int | None = None) -> LaunchPlan:
  """The plan `block_attention` uses for q [b, nq, hq, D], hkv KV heads and a [b, table_width] page table of
  `page_size`-token pages. `num_splits` forces the split count (capped at one step per split); None applies
  `common.gpu_num_splits`."""
  g = hq // hkv
  qp, gp = common.next_pow2(nq), common.next_pow2(g)
  rows = max(16, gp * qp)
  bs = block_sizes or common.pick_block_sizes(common.GPU_BLOCK_TABLE, rows)
  block_r = min(bs.block_r, rows)
  ppb = max(1, bs.block_k // page_size)
  steps = max(1, -(-table_width // ppb))
  if num_splits is None:
    splits, per = common.gpu_num_splits(b * hkv * (rows // block_r), steps, ppb * page_size)
  else:
    if num_splits < 1:
      raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    per = -(-steps // min(num_splits, steps))
    splits = -(-steps // per)
  return LaunchPlan(qp=qp, gp=gp, kp=max(16, qp), rows=rows, block_r=block_r, ppb=ppb, splits=splits,
                    steps_per_split=per, block_sizes=bs)


def _kernel(*refs, mask_kind: str, nq: int, qp: int, block_r: int, ppb: int, steps_per_split: int, partial: bool,
            scale: float, precision):
  if mask_kind == "tree":
    q_ref, kb_ref, vb_ref, words_ref, pt_ref, plen_ref, k_ref, v_ref, *out_refs = refs
  else:
    q_ref, kb_ref, vb_ref, pt_ref, plen_ref, k_ref, v_ref, *out_refs = refs
  page_size, d = k_ref.shape[1], k_ref.shape[2]
  block_k = ppb * page_size
  q = q_ref[...]  # [block_r, D]
  rows = pl.program_id(2) * block_r + jnp.arange(block_r, dtype=jnp.int32)
  split = pl.program_id(3)

  # 1. the block's own keys, counted once: in split 0 (the other splits see none of them)
  kb = kb_ref[...]
  s = plgpu.dot(q, kb.astype(q.dtype), trans_b=True, precision=precision).astype(jnp.float32) * scale
  cols = jnp.broadcast_to(jnp.arange(kb.shape[0], dtype=jnp.int32)[None, :], s.shape)
  if mask_kind == "tree":
    visible = common.unpack_mask_bits([words_ref[w, :][:, None] for w in range(words_ref.shape[0])], cols)
  else:
    visible = cols < nq
    if mask_kind == "causal":
      visible = visible & (cols <= (rows & (qp - 1))[:, None])  # qp is a power of two
  visible = visible & (split == 0)
  s = jnp.where(visible, s, NEG_INF)
  m = jnp.max(s, axis=1)
  p = jnp.where(visible, jnp.exp(s - m[:, None]), 0.0)
  l = jnp.sum(p, axis=1)
  vb = vb_ref[...]
  acc = plgpu.dot(p.astype(vb.dtype), vb, precision=precision).astype(jnp.float32)

  # 2. this split's part of the committed prefix, block_k keys per step
  prefix_len = plen_ref[0]
  first = split * steps_per_split

  def step(j, carry):
    acc, m, l = carry
    c = first + j
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

  remaining = jnp.maximum(prefix_len - first * block_k, 0)  # non-negative: a plain ceil-div
  steps = jnp.minimum(pl.cdiv(remaining, block_k), steps_per_split)
  acc, m, l = jax.lax.fori_loop(0, steps, step, (acc, m, l))
  # 3. one split: normalise here (rows that saw no key at all, padding only, have l = 0); several: the partials
  if partial:
    acc_ref, m_ref, l_ref = out_refs
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l
  else:
    o_ref, = out_refs
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
  """Log-sum-exp merge of split partials along axis 2: acc [..., S, R, D], m/l [..., S, R] -> [..., R, D] fp32.
  Splits that saw no key (m = -1e30, l = 0, acc = 0) get weight 0 next to any that did; rows no split saw end 0."""
  m_all = jnp.max(m, axis=2, keepdims=True)
  w = jnp.exp(m - m_all)
  l_all = jnp.sum(w * l, axis=2)
  out = jnp.sum(w[..., None] * acc, axis=2)
  return out / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]


@functools.partial(jax.jit, static_argnames=("mask_kind", "scale", "interpret", "block_sizes", "num_splits"))
def _attention(q, k_block, v_block, tree_mask, k_pages, v_pages, page_table, prefix_len, layer=None, *, mask_kind,
               scale, interpret, block_sizes, num_splits=None):
  b, nq, hq, d = q.shape
  hkv = k_block.shape[2]
  page_size = common.layer_pages(k_pages, layer)[1]
  plan = launch_plan(b, nq, hq, hkv, page_size, page_table.shape[1], block_sizes, num_splits)
  qp, gp, kp, rows, block_r, ppb = plan.qp, plan.gp, plan.kp, plan.rows, plan.block_r, plan.ppb
  k_pages, offset = common.layer_view(k_pages, layer)
  v_pages, _ = common.layer_view(v_pages, layer)
  # the page table covers every split's steps; padded ids (0) are valid addresses whose keys are masked
  width = plan.splits * plan.steps_per_split * ppb
  pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - page_table.shape[1]))) + offset
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  qf = common.fold_queries(q, hkv, qp, gp, rows)
  inputs = [qf, common.fold_block_kv(k_block, kp), common.fold_block_kv(v_block, kp)]
  in_specs = [pl.BlockSpec((None, None, block_r, d), lambda r, h, i, s: (r, h, i, 0)),
              pl.BlockSpec((None, None, kp, d), lambda r, h, i, s: (r, h, 0, 0)),
              pl.BlockSpec((None, None, kp, d), lambda r, h, i, s: (r, h, 0, 0))]
  if mask_kind == "tree":
    words = common.pack_mask_rows(tree_mask, qp, gp, rows, kp, word_major=True)
    inputs.append(words)
    in_specs.append(pl.BlockSpec((None, words.shape[1], block_r), lambda r, h, i, s: (r, 0, i)))
  inputs += [pt, prefix_len.astype(jnp.int32)[:, None], k_pages, v_pages]
  pages_spec = pl.BlockSpec((k_pages.shape[0], page_size, d), lambda r, h, i, s: (0, 0, h))  # head h's D columns
  in_specs += [pl.BlockSpec((None, width), lambda r, h, i, s: (r, 0)),
               pl.BlockSpec((None, 1), lambda r, h, i, s: (r, 0)), pages_spec, pages_spec]

  partial = plan.splits > 1
  if partial:
    split_shape = (b, hkv, plan.splits, rows)
    out_shape = [jax.ShapeDtypeStruct(split_shape + (d,), jnp.float32), jax.ShapeDtypeStruct(split_shape, jnp.float32),
                 jax.ShapeDtypeStruct(split_shape, jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, block_r, d), lambda r, h, i, s: (r, h, s, i, 0)),
                 pl.BlockSpec((None, None, None, block_r), lambda r, h, i, s: (r, h, s, i)),
                 pl.BlockSpec((None, None, None, block_r), lambda r, h, i, s: (r, h, s, i))]
  else:
    out_shape = jax.ShapeDtypeStruct(qf.shape, q.dtype)
    out_specs = pl.BlockSpec((None, None, block_r, d), lambda r, h, i, s: (r, h, i, 0))
  kernel = functools.partial(_kernel, mask_kind=mask_kind, nq=nq, qp=qp, block_r=block_r, ppb=ppb,
                             steps_per_split=plan.steps_per_split, partial=partial, scale=scale, precision=precision)
  out = pl.pallas_call(
    kernel,
    grid=(b, hkv, rows // block_r, plan.splits),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=plgpu.CompilerParams(num_warps=plan.block_sizes.num_warps,
                                         num_stages=plan.block_sizes.num_stages),
    interpret=interpret,
    name=f"block_attention_{mask_kind}",
  )(*inputs)
  if partial:
    out = combine_splits(*out).astype(q.dtype)
  return common.unfold_out(out, nq, hq, qp, gp)


def block_attention(q: jax.Array, k_block: jax.Array, v_block: jax.Array, block_mask, *,
                    k_pages: jax.Array | None = None, v_pages: jax.Array | None = None,
                    page_table: jax.Array | None = None, prefix_len: jax.Array | None = None, scale: float,
                    layer: int | jax.Array | None = None, interpret: bool = False,
                    block_sizes: common.BlockSizes | None = None, num_splits: int | None = None):
  """Same contract as `block_attention_ref`; `block_mask` may also be "causal" or "full".

  q: [b, Q, Hq, D] (already carrying the model's query scale); k_block/v_block: [b, Q, Hkv, D]; block_mask:
  [b, Q, Q] / [Q, Q] bool or a kind; k_pages/v_pages: [num_pages, page_size, Hkv * D], or with `layer` (an int or
  an int32 scalar, e.g. a scan's layer index) all layers stacked [L, num_pages, page_size, Hkv * D], read in place;
  page_table: [b, P] (ids into one layer's pages); prefix_len: [b]. Without page_table the prefix is empty.
  Returns [b, Q, Hq, D] in q's dtype. `num_splits` overrides the prefix split count
  (default: `common.gpu_num_splits`; see `launch_plan`).
  """
  return common.run_block_attention(
      _attention, 16, q, k_block, v_block, block_mask, k_pages=k_pages, v_pages=v_pages,
      page_table=page_table, prefix_len=prefix_len, scale=scale, interpret=interpret,
      block_sizes=block_sizes, layer=layer, num_splits=num_splits)


block_attention_ref = common.block_attention_ref  # the twin: one pure-jnp reference serves both backends
