"""K/V write of a block into its pages: GPU kernel (Pallas Triton backend), standalone or fused.

Token (r, t) goes to slot `positions[r, t]` of request r through the page table, write=False tokens to
`trash_page`; the destinations come from `common.write_slots`, the same formula as the twin `kv_write_ref`. Triton
has no scalar prefetch, so one program per token reads its (page, offset) pair and stores its [D] row per KV head
through pointer arithmetic into the whole page array, which is aliased input -> output (updated in place). Stacked
pages [L, N, ...] with `layer` are viewed as [L * N, ...] and the layer's offset is added to the page ids, so the
kernel writes into that layer of the stacked array without slicing it out.

Two tokens with the same slot (only the trash page, or tree nodes sharing a position) land in an unspecified order,
exactly as with XLA's scatter in `kv_write_ref`.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common


def _kernel(slot_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref):
  del k_in_ref, v_in_ref  # aliased to the outputs
  page, off = slot_ref[0], slot_ref[1]
  for h in range(k_new_ref.shape[0]):
    k_out_ref[page, off, h, :] = k_new_ref[h, :]
    v_out_ref[page, off, h, :] = v_new_ref[h, :]


@functools.partial(jax.jit, static_argnames=("trash_page", "interpret"), donate_argnums=(0, 1))
def kv_write(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array, page_table: jax.Array,
             positions: jax.Array, write: jax.Array, *, layer: int | jax.Array | None = None, trash_page: int = 0,
             interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Same contract as `kv_write_ref`: k_new/v_new [b, T, Hkv, D] into k_pages/v_pages [N, ps, Hkv, D] (or stacked
  [L, N, ps, Hkv, D] at `layer`), which are donated and updated in place."""
  common.check_layer(k_pages, layer, "k_pages")
  common.check_layer(v_pages, layer, "v_pages")
  page_size, hkv, d = k_pages.shape[-3:]
  b, tokens = positions.shape
  page, off = common.write_slots(page_table, positions, write, page_size, trash_page)
  k_flat, offset = common.layer_view(k_pages, layer)
  v_flat, _ = common.layer_view(v_pages, layer)
  slots = jax.numpy.stack([page + offset, off], axis=-1)  # [b, T, 2]
  token_spec = pl.BlockSpec((None, None, hkv, d), lambda r, t: (r, t, 0, 0))
  whole = lambda x: pl.BlockSpec(x.shape, lambda r, t: (0,) * x.ndim)
  k_out, v_out = pl.pallas_call(
    _kernel,
    grid=(b, tokens),
    in_specs=[pl.BlockSpec((None, None, 2), lambda r, t: (r, t, 0)), token_spec, token_spec, whole(k_flat),
              whole(v_flat)],
    out_specs=[whole(k_flat), whole(v_flat)],
    out_shape=[jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype), jax.ShapeDtypeStruct(v_flat.shape, v_flat.dtype)],
    input_output_aliases={3: 0, 4: 1},
    compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
    interpret=interpret,
    name="kv_write",
  )(slots, k_new.astype(k_pages.dtype), v_new.astype(v_pages.dtype), k_flat, v_flat)
  return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)


kv_write_ref = common.kv_write_ref  # the twin: one pure-jnp scatter serves both backends
