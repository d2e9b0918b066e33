"""Pallas kernels for block-diffusion attention over the paged KV cache (see docs/kernels.md).

- `block_attention_tpu`: Mosaic (TPU) kernel, scalar-prefetched page table, BlockSpecs over pages.
- `block_attention_gpu`: Triton (GPU) kernel, page gather through the page table inside the kernel.
- `kv_write_tpu` / `kv_write_gpu`: the fused write of a block's K/V into its pages (same cache as
  `recguide_jax.kv_cache.write_block`), run after the attention by `block_attention(..., write_positions=...)`.
- `common`: the GQA-folded layout, packed tree masks and the per-backend block-size tables.

Every kernel takes `interpret=` (True runs it on CPU) and has a pure-jnp `*_ref` twin; `recguide_jax.
attention_dispatch` picks between kernels and the reference for the model.
"""

from pallas_kernels import block_attention_gpu, block_attention_tpu, common, kv_write_gpu, kv_write_tpu

__all__ = ["block_attention_gpu", "block_attention_tpu", "common", "kv_write_gpu", "kv_write_tpu"]
