"""Layout shared by the block-attention kernels: mask kinds, the GQA-folded query layout, packed tree masks, the
placeholder prefix for calls without a cache, and the per-backend block-size tables.

Folded layout. A kernel program works on one request and (part of) one KV head. The g = Hq / Hkv query heads that
share a KV head are stacked along the row axis, group-major: row = j * Qp + t for query head j of the group and
query token t, Qp being Q padded to what the backend's matmul wants. The query token of a row is therefore
`row % Qp`, so the intra-block mask never has to be repeated per head inside the kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from recguide_jax.kv_cache import TRASH_PAGE

NEG_INF = -1e30  # the reference's finite "masked" score, so a fully masked row stays NaN-free
MASK_KINDS = ("causal", "full", "tree")
WORD_BITS = 32  # a tree-mask row is packed into int32 words, bit c % 32 of word c // 32 = key column c


def next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def mask_kind_of(block_mask) -> str:
  """The kernel's mask kind: "causal"/"full" for a string or for a concrete mask equal to one (so jitted callers
  that close over `jnp.tril(...)` still get the cheap iota mask); "tree" for anything else, including traced masks."""
  if isinstance(block_mask, str):
    if block_mask not in ("causal", "full"):
      raise ValueError(f"mask kind must be 'causal' or 'full' (or a boolean array), got {block_mask!r}")
    return block_mask
  try:
    m = np.asarray(block_mask).astype(bool)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return "tree"  # a traced mask: its values are only known on the device
  q = m.shape[-1]
  if m.all():
    return "full"
  if (m == np.tril(np.ones((q, q), bool))).all():
    return "causal"
  return "tree"


def dense_mask(block_mask, b: int, q: int) -> jax.Array:
  """The [b, Q, Q] boolean mask a kind string or a [Q, Q] / [b, Q, Q] array stands for."""
  if isinstance(block_mask, str):
    m = np.tril(np.ones((q, q), bool)) if block_mask == "causal" else np.ones((q, q), bool)
    block_mask = jnp.asarray(m)
  block_mask = jnp.asarray(block_mask).astype(bool)
  return jnp.broadcast_to(block_mask, (b, q, q))


def pack_mask_rows(mask: jax.Array, qp: int, groups: int, rows: int, cols: int, *, word_major: bool) -> jax.Array:
  """[b, Q, Q] bool -> int32 words in the folded row order, W = cols / 32 words per row: [b, W, rows] when
  `word_major` (GPU: one word of all rows is a contiguous vector) else [b, rows, W] (TPU: rows on sublanes, so a
  word column broadcasts across the key lanes). Padded rows and columns are 0 bits."""
  b, q, _ = mask.shape
  w = -(-cols // WORD_BITS)
  m = jnp.zeros((b, qp, w * WORD_BITS), bool).at[:, :q, :q].set(mask)
  bits = m.reshape(b, qp, w, WORD_BITS).astype(jnp.uint32) << jnp.arange(WORD_BITS, dtype=jnp.uint32)
  words = jax.lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)  # [b, Qp, W]
  words = jnp.tile(words, (1, groups, 1))  # row j * Qp + t carries token t's bits
  words = jnp.pad(words, ((0, 0), (0, rows - groups * qp), (0, 0)))
  return jnp.swapaxes(words, 1, 2) if word_major else words


def unpack_mask_bits(word_cols, cols):
  """Visibility from packed words inside a kernel: `word_cols` is a list of [R, 1] int32 columns (one per word),
  `cols` an [R, C] key-column iota. Picking the word with `where` keeps this to elementwise ops, which both
  Triton and Mosaic lower."""
  # shifts and masks instead of // and %: those bring sign fix-ups the Mosaic lowering would rather not see
  word_idx = jax.lax.shift_right_logical(cols, jnp.int32(5))
  bits = jnp.zeros(cols.shape, jnp.int32)
  for w, word in enumerate(word_cols):
    bits = jnp.where(word_idx == w, jnp.broadcast_to(word, cols.shape), bits)
  return (jax.lax.shift_right_logical(bits, cols & (WORD_BITS - 1)) & 1) != 0


def fold_queries(q: jax.Array, hkv: int, qp: int, gp: int, rows: int) -> jax.Array:
  """[b, Q, Hq, D] -> [b, Hkv, rows, D]: pad tokens to Qp and groups to gp, stack group-major, pad rows."""
  b, nq, hq, d = q.shape
  g = hq // hkv
  qf = q.reshape(b, nq, hkv, g, d)
  qf = jnp.pad(qf, ((0, 0), (0, qp - nq), (0, 0), (0, gp - g), (0, 0)))
  qf = qf.transpose(0, 2, 3, 1, 4).reshape(b, hkv, gp * qp, d)
  return jnp.pad(qf, ((0, 0), (0, 0), (0, rows - gp * qp), (0, 0)))


def unfold_out(o: jax.Array, nq: int, hq: int, qp: int, gp: int) -> jax.Array:
  """Inverse of `fold_queries`: [b, Hkv, rows, D] -> [b, Q, Hq, D]."""
  b, hkv, _, d = o.shape
  g = hq // hkv
  o = o[:, :, :gp * qp].reshape(b, hkv, gp, qp, d)[:, :, :g, :nq]
  return o.transpose(0, 3, 1, 2, 4).reshape(b, nq, hq, d)


def fold_block_kv(x: jax.Array, kp: int) -> jax.Array:
  """[b, Q, Hkv, D] -> [b, Hkv, Kp, D] (block keys padded to Kp; padded keys are masked)."""
  return jnp.pad(x, ((0, 0), (0, kp - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)


def placeholder_prefix(b: int, hkv: int, d: int, dtype, page_size: int):
  """An empty prefix (one zero page, length 0) for calls without a cache, so the kernels keep a single code
  path; no key of it is ever visible."""
  pages = jnp.zeros((1, page_size, hkv, d), dtype)
  return pages, pages, jnp.zeros((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32)


# ---- block sizes ---------------------------------------------------------------------------------------------------
# Keyed on the folded rows of one request and KV head (R = g * Qp). Starting points chosen from the shapes (register
# budget of a [block_r, 128] fp32 accumulator on GPU, grid-step overhead vs VMEM on TPU), not tuned on hardware yet:
# see docs/kernels.md and launch/bench_kernels.py.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  block_r: int  # GPU: folded query rows per program (the TPU kernel keeps all rows of a request in one program)
  block_k: int  # prefix keys per inner step, rounded to whole pages (at least one page)
  num_warps: int = 4  # GPU only
  num_stages: int = 2  # GPU only


GPU_BLOCK_TABLE: tuple[tuple[int, BlockSizes], ...] = (
  (16, BlockSizes(block_r=16, block_k=128, num_warps=4)),  # AR decode / short verify: bandwidth bound
  (64, BlockSizes(block_r=64, block_k=64, num_warps=4)),  # B = 8..16 blocks with GQA 4
  (1 << 30, BlockSizes(block_r=64, block_k=64, num_warps=8)),  # B = 32 and tree layouts: split rows over programs
)

TPU_BLOCK_TABLE: tuple[tuple[int, BlockSizes], ...] = (
  (64, BlockSizes(block_r=0, block_k=512)),
  (256, BlockSizes(block_r=0, block_k=256)),
  (1 << 30, BlockSizes(block_r=0, block_k=128)),  # large trees: keep the [Hkv, R, block_k] scores in VMEM
)


def pick_block_sizes(table, rows: int) -> BlockSizes:
  for max_rows, bs in table:
    if rows <= max_rows:
      return bs
  return table[-1][1]


def write_slots(page_table: jax.Array, positions: jax.Array, write: jax.Array, page_size: int):
  """(page, offset) of every token, int32 [b, T] each, computed exactly as `kv_cache.write_block` does, so the
  write kernels fill the same slots (write=False tokens go to the trash page)."""
  logical = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
  page = jnp.take_along_axis(page_table, logical, axis=1)
  page = jnp.where(write, page, TRASH_PAGE)
  return page.astype(jnp.int32), (positions % page_size).astype(jnp.int32)


def run_block_attention(attention, kv_write_fn, placeholder_page_size: int, q, k_block, v_block, block_mask, *,
                        k_pages, v_pages, page_table, prefix_len, scale, write_positions, write, interpret,
                        block_sizes):
  """The shared entry of both backends' `block_attention`: mask-kind dispatch, the empty-prefix placeholder, the
  kernel call, then the optional fused K/V write (after the attention, whose prefix must not see the block's own
  entries). `attention` and `kv_write_fn` are the backend's kernels."""
  b, nq, _, d = q.shape
  kind = mask_kind_of(block_mask)
  tree = dense_mask(block_mask, b, nq) if kind == "tree" else None
  if page_table is None:
    if write_positions is not None:
      raise ValueError("a fused K/V write needs the page table")
    prefix = placeholder_prefix(b, k_block.shape[2], d, k_block.dtype, placeholder_page_size)
  else:
    prefix = (k_pages, v_pages, page_table, prefix_len)
  out = attention(q, k_block, v_block, tree, *prefix, mask_kind=kind, scale=float(scale), interpret=interpret,
                  block_sizes=block_sizes)
  if write_positions is None:
    return out
  write = jnp.ones(write_positions.shape, bool) if write is None else write
  k_pages, v_pages = kv_write_fn(k_pages, v_pages, k_block, v_block, page_table, write_positions, write,
                                 interpret=interpret)
  return out, k_pages, v_pages


def block_attention_ref(q, k_block, v_block, block_mask, *, k_pages=None, v_pages=None, page_table=None,
                        prefix_len=None, scale: float) -> jax.Array:
  """Pure-jnp twin of both kernels: the project's reference with the same mask-kind shorthand."""
  from recguide_jax import attention as attn_lib
  mask = dense_mask(block_mask, q.shape[0], q.shape[1])
  return attn_lib.block_attention_ref(q, k_block, v_block, mask, k_pages=k_pages, v_pages=v_pages,
                                      page_table=page_table, prefix_len=prefix_len, scale=scale)
