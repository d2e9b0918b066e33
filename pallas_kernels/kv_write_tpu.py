"""Fused K/V write of a block into its pages: TPU kernel (Pallas Mosaic, DMA from HBM to HBM).

Token (r, t) goes to slot `positions[r, t]` of request r through the page table, write=False tokens to the trash
page: the destinations come from `common.write_slots`, the same formula as `kv_cache.write_block`, and are
scalar-prefetched. A write is one [1, Hkv * D] row, which no (8, 128)-tiled BlockSpec can address, so the pages
stay in HBM (`pl.ANY`, aliased input -> output, i.e. updated in place) and each row is one async copy. A program
(one request) starts all of its 2T copies before waiting on any, so their latencies overlap.

Two tokens with the same slot (only the trash page, or tree nodes sharing a position) land in an unspecified order,
exactly as with XLA's scatter in `write_block`.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from recguide_jax import kv_cache


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


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1))
def kv_write(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array, page_table: jax.Array,
             positions: jax.Array, write: jax.Array, *, interpret=False) -> tuple[jax.Array, jax.Array]:
  """Same contract as `kv_cache.write_block` (k_pages/v_pages are donated and updated in place)."""
  n, page_size, hkv, d = k_pages.shape
  b, tokens = positions.shape
  page, off = common.write_slots(page_table, positions, write, page_size)
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
  )(page.reshape(-1), off.reshape(-1), flat(k_new.astype(k_pages.dtype), (b, tokens)),
    flat(v_new.astype(v_pages.dtype), (b, tokens)), flat(k_pages, (n, page_size)), flat(v_pages, (n, page_size)))
  return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)


kv_write_ref = kv_cache.write_block  # the pure-jnp twin is the cache's own scatter
