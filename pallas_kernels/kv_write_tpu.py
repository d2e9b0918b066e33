"""K/V write of a block into its pages: TPU kernel (Pallas Mosaic, DMA from HBM to HBM), standalone or fused.

Token (r, t) goes to slot `positions[r, t]` of request r through the page table, write=False tokens to
`trash_page`: the destinations come from `common.write_slots`, the same formula as the twin `kv_write_ref`, and are
scalar-prefetched (with stacked pages [L, N, ...] and `layer`, as page ids into the [L * N, ...] view, so the copy
lands in that layer of the stacked array in place). A write is one [1, Hkv * D] row, which no (8, 128)-tiled
BlockSpec can address, so the pages stay in HBM (`pl.ANY`, aliased input -> output, i.e. updated in place) and each row is one async copy. A program
(one request) starts all of its 2T copies before waiting on any, so their latencies overlap.

Two tokens with the same slot (only the trash page, or tree nodes sharing a position) land in an unspecified order,
exactly as with XLA's scatter in `kv_write_ref`.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common


def _kernel(page_ref, off_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref, sem, *, tokens):
  del k_in_ref, v_in_ref  # aliased to the outputs
  r = pl.program_id(0)
  copies = []
  for t in range(tokens):
    page, off = page_ref[r * tokens + t], off_ref[r * tokens + t]
    for i, (src, dst) in enumerate(((k_new_ref, k_out_ref), (v_new_ref, v_out_ref))):
      copy = pltpu.make_async_copy(src.at[r, pl.ds(t, 1)], dst.at[page, pl.ds(off, 1)], sem.at[i])
      copy.start()
      copies.append(copy)
  for copy in copies:
    copy.wait()


@functools.partial(jax.jit, static_argnames=("trash_page", "interpret"), donate_argnums=(0, 1))
def kv_write(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array, page_table: jax.Array,
             positions: jax.Array, write: jax.Array, *, layer: int | jax.Array | None = None, trash_page: int = 0,
             interpret=False) -> tuple[jax.Array, jax.Array]:
  """Same contract as `kv_write_ref`: k_new/v_new [b, T, Hkv, D] into k_pages/v_pages [N, ps, Hkv, D] (or stacked
  [L, N, ps, Hkv, D] at `layer`), which are donated and updated in place."""
  common.check_layer(k_pages, layer, "k_pages")
  common.check_layer(v_pages, layer, "v_pages")
  page_size, hkv, d = k_pages.shape[-3:]
  b, tokens = positions.shape
  page, off = common.write_slots(page_table, positions, write, page_size, trash_page)
  k_flat, offset = common.layer_view(k_pages, layer)
  v_flat, _ = common.layer_view(v_pages, layer)
  n = k_flat.shape[0]
  flat = lambda x, lead: x.reshape(*lead, hkv * d)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  k_out, v_out = pl.pallas_call(
    functools.partial(_kernel, tokens=tokens),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b,), in_specs=[any_spec] * 4, out_specs=[any_spec] * 2,
      scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
    out_shape=[jax.ShapeDtypeStruct((n, page_size, hkv * d), k_pages.dtype),
               jax.ShapeDtypeStruct((n, page_size, hkv * d), v_pages.dtype)],
    input_output_aliases={4: 0, 5: 1},  # operands: page, off, k_new, v_new, k_pages, v_pages
    compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    interpret=interpret,
    name="kv_write",
  )((page + offset).reshape(-1), off.reshape(-1), flat(k_new.astype(k_pages.dtype), (b, tokens)),
    flat(v_new.astype(v_pages.dtype), (b, tokens)), flat(k_flat, (n, page_size)), flat(v_flat, (n, page_size)))
  return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)


kv_write_ref = common.kv_write_ref  # the twin: one pure-jnp scatter serves both backends
