"""Layout shared by the block-attention kernels: mask kinds, the GQA-folded query layout, packed tree masks, the
placeholder prefix for calls without a cache, the page layouts, the per-backend block-size tables, and the pure-jnp
references both backends' `_ref` twins are.

Page layouts. The cache is either one layer's pages [num_pages, page_size, Hkv * D] (`layer=None`) or all layers'
pages stacked [L, num_pages, page_size, Hkv * D] with `layer` an int or an int32 scalar (traced inside a scan over
layers). The KV heads are folded into the last dim (head h on [h * D, (h + 1) * D)): a TPU tiles the two minor
dims, so the Mosaic kernel can DMA [page_size, Hkv * D] pages as they lie in HBM; an unfolded [.., Hkv, D] cache
would be relaid out, whole, before every call. The kernels never slice a layer out (that would copy a whole layer per call): they view the stacked array
as [L * num_pages, ...] (a free reshape of a contiguous array) and add `layer * num_pages` to the page ids, so the
page table itself carries the layer (`layer_view`). The kernels only read pages (the application writes a block's
K/V with its own scatter): this package knows nothing of the application that allocates them.

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

NEG_INF = -1e30  # the reference's finite "masked" score, so a fully masked row stays NaN-free
MASK_KINDS = ("causal", "full", "tree")
WORD_BITS = 32  # a tree-mask row is packed into int32 words, bit c % 32 of word c // 32 = key column c


def next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def causal_mask(q: int) -> np.ndarray:
  """[q, q]: each query sees itself and the block's earlier keys (prefill, verify, AR)."""
  return np.tril(np.ones((q, q), bool))


def full_mask(q: int) -> np.ndarray:
  """[q, q]: each query sees the whole block (a diffusion draft)."""
  return np.ones((q, q), bool)


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
  if (m == causal_mask(q)).all():
    return "causal"
  return "tree"


def dense_mask(block_mask, b: int, q: int) -> jax.Array:
  """The [b, Q, Q] boolean mask a kind string or a [Q, Q] / [b, Q, Q] array stands for."""
  if isinstance(block_mask, str):
    m = causal_mask(q) if block_mask == "causal" else full_mask(q)
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
  pages = jnp.zeros((1, page_size, hkv * d), dtype)
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


# Split-K (flash-decoding) on GPU. The grid (request, KV head, row block) has b * Hkv * R / block_r programs: 8 for
# one decode request of the 8B model, on a 132-SM H200. A fourth grid axis splits the prefix walk: each split walks
# its own range of the page table to a partial (running max, denominator, unnormalised output), and the splits are
# merged by their log-sum-exp. The split count is static (a shape): it comes from the page-table width P, the widest
# prefix the call can see, and from the number of programs without splits:
#   splits = min(ceil(GPU_TARGET_PROGRAMS / programs), max(1, P * page_size // GPU_MIN_KEYS_PER_SPLIT))
# then rounded so every split covers the same whole number of block_k steps. Enough programs already (large batch,
# long trees): 1 split, the single-pass kernel with no partials in memory.
GPU_TARGET_PROGRAMS = 2 * 132  # two thread blocks per SM of an H100/H200 (B200: 148 SMs, close enough)
GPU_MIN_KEYS_PER_SPLIT = 256  # below this a split's partial (D fp32 per row) and its launch cost rival its reads


def gpu_num_splits(programs: int, prefix_steps: int, block_k: int, *, target: int = GPU_TARGET_PROGRAMS,
                   min_keys: int = GPU_MIN_KEYS_PER_SPLIT) -> tuple[int, int]:
  """-> (splits, block_k steps per split) for `programs` grid programs without splits and a prefix walk of
  `prefix_steps` steps of `block_k` keys (the whole page-table width). splits * steps_per_split >= prefix_steps."""
  if prefix_steps <= 1 or programs >= target:
    return 1, max(prefix_steps, 1)
  want = -(-target // programs)
  most = max(1, prefix_steps * block_k // min_keys)
  splits = max(1, min(want, most, prefix_steps))
  steps = -(-prefix_steps // splits)
  return -(-prefix_steps // steps), steps


def pick_block_sizes(table, rows: int) -> BlockSizes:
  for max_rows, bs in table:
    if rows <= max_rows:
      return bs
  return table[-1][1]


def check_layer(pages: jax.Array, layer, name: str = "k_pages", heads_dim: int | None = None) -> None:
  """Shape check of a page array against `layer` (None: [N, ps, H * D]; else stacked [L, N, ps, H * D]) and, when
  given, the folded `heads_dim` = H * D of the block's K/V."""
  want = 3 if layer is None else 4
  if pages.ndim != want or (heads_dim is not None and pages.shape[-1] != heads_dim):
    layout = "[num_pages, page_size, kv_heads * head_dim]" if layer is None else (
        "[layers, num_pages, page_size, kv_heads * head_dim] (stacked, with layer=)")
    want_last = "" if heads_dim is None else f" with a last dim of {heads_dim}"
    raise ValueError(f"{name} must be {layout}{want_last}, got shape {tuple(pages.shape)}")
  if layer is not None and isinstance(layer, (int, np.integer)) and not 0 <= layer < pages.shape[0]:
    raise ValueError(f"layer={layer} out of range for {pages.shape[0]} stacked layers")


def layer_view(pages: jax.Array, layer) -> tuple[jax.Array, jax.Array | int]:
  """-> (pages as [L * N, ps, H * D], page-id offset of `layer`): a free reshape instead of a per-layer slice.
  `layer=None` is the single-layer layout, offset 0."""
  if layer is None:
    return pages, 0
  num_layers, n = pages.shape[:2]
  return pages.reshape(num_layers * n, *pages.shape[2:]), jnp.asarray(layer, jnp.int32) * n


def layer_pages(pages: jax.Array, layer) -> tuple[int, ...]:
  """The per-layer page shape [N, ps, H * D] of either layout."""
  return tuple(pages.shape if layer is None else pages.shape[1:])


def run_block_attention(attention, placeholder_page_size: int, q, k_block, v_block, block_mask, *, k_pages, v_pages,
                        page_table, prefix_len, scale, interpret, block_sizes, layer, **kernel_kwargs):
  """The shared entry of both backends' `block_attention`: mask-kind dispatch, the empty-prefix placeholder and the
  kernel call. `attention` is the backend's kernel."""
  b, nq, _, d = q.shape
  kind = mask_kind_of(block_mask)
  tree = dense_mask(block_mask, b, nq) if kind == "tree" else None
  if page_table is None:
    prefix = placeholder_prefix(b, k_block.shape[2], d, k_block.dtype, placeholder_page_size)
    layer_arg = None
  else:
    heads_dim = k_block.shape[2] * d
    check_layer(k_pages, layer, "k_pages", heads_dim)
    check_layer(v_pages, layer, "v_pages", heads_dim)
    prefix = (k_pages, v_pages, page_table, prefix_len)
    layer_arg = layer
  return attention(q, k_block, v_block, tree, *prefix, layer_arg, mask_kind=kind, scale=float(scale),
                   interpret=interpret, block_sizes=block_sizes, **kernel_kwargs)


# ---- pure-jnp references (the kernels' `_ref` twins) ---------------------------------------------------------------


def _gather_prefix(pages: jax.Array, page_table: jax.Array, layer, kv_heads: int) -> jax.Array:
  """[(L,) N, ps, H * D] x [b, P] -> [b, P * ps, H, D]: one gather, with the layer as a gather index (no slice)."""
  g = pages[page_table] if layer is None else pages[layer, page_table]
  b, p, s, hd = g.shape
  return g.reshape(b, p * s, kv_heads, hd // kv_heads)


def block_attention_ref(q, k_block, v_block, block_mask, *, k_pages=None, v_pages=None, page_table=None,
                        prefix_len=None, scale: float, layer=None) -> jax.Array:
  """The kernels' contract in plain jnp: softmax (fp32) over the prefix [0, prefix_len[r]) read through the page
  table plus the block's own keys under `block_mask` ([Q, Q] / [b, Q, Q] bool or "causal" / "full").

  q: [b, Q, Hq, D]; k_block/v_block: [b, Q, Hkv, D]; k_pages/v_pages: [N, ps, Hkv * D], or [L, N, ps, Hkv * D]
  with `layer`; page_table: [b, P] int32; prefix_len: [b]. Returns [b, Q, Hq, D] in q's dtype."""
  b, nq, hq, d = q.shape
  hkv = k_block.shape[2]
  qf = q.reshape(b, nq, hkv, hq // hkv, d)
  mask = dense_mask(block_mask, b, nq)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k_block.astype(q.dtype), preferred_element_type=jnp.float32) * scale
  scores, values = [jnp.where(mask[:, None, None], s, NEG_INF)], [v_block]
  if page_table is not None:
    check_layer(k_pages, layer, "k_pages", hkv * d)
    k_pre = _gather_prefix(k_pages, page_table, layer, hkv)
    v_pre = _gather_prefix(v_pages, page_table, layer, hkv)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k_pre.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(k_pre.shape[1])[None, :] < prefix_len[:, None]  # [b, S]
    scores.insert(0, jnp.where(valid[:, None, None, None, :], s, NEG_INF))
    values.insert(0, v_pre.astype(v_block.dtype))
  p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  v = jnp.concatenate(values, axis=1)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, nq, hq, d).astype(q.dtype)
