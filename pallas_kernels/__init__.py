"""Pallas kernels for block-diffusion attention over the paged KV cache (see docs/kernels.md).

- `block_attention_tpu`: Mosaic (TPU) kernel, scalar-prefetched page table, BlockSpecs over pages.
- `block_attention_gpu`: Triton (GPU) kernel, page gather through the page table inside the kernel, the prefix
  split across the grid (flash-decoding) when the batch alone would not fill the GPU.
- `common`: the GQA-folded layout, packed tree masks, page layouts, block-size tables, split rule, and the pure-jnp
  reference `block_attention_ref` (each kernel module re-exports it as its `_ref` twin).

Every kernel takes `interpret=` (True runs it on CPU) and reads either one layer's pages [N, ps, Hkv * D] or all
layers' stacked [L, N, ps, Hkv * D] at `layer=` (in place): the page layout is a parameter. The kernels only read
the cache; writing a block's K/V is the application's scatter (`recguide_jax.cache.kv_cache.write_block`). This package
depends on jax only, not on the application (`recguide_jax.attention.dispatch` picks between kernels and reference
for the model).
"""

# The kernel modules import jax's Pallas backends (Triton, Mosaic); they load when first named, so importing the
# reference (`pallas_kernels.common`) costs nothing more than jax.
__all__ = ["block_attention_gpu", "block_attention_tpu", "common"]


def __getattr__(name):
  if name in __all__:
    import importlib
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
