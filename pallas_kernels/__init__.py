"""Pallas kernels for block-diffusion attention over the paged KV cache (see docs/kernels.md).

- `block_attention_tpu`: Mosaic (TPU) kernel, scalar-prefetched page table, BlockSpecs over pages.
- `block_attention_gpu`: Triton (GPU) kernel, page gather through the page table inside the kernel, the prefix
  split across the grid (flash-decoding) when the batch alone would not fill the GPU.
- `kv_write_tpu` / `kv_write_gpu`: the write of a block's K/V into its pages, standalone or fused after the
  attention by `block_attention(..., write_positions=...)`.
- `common`: the GQA-folded layout, packed tree masks, page layouts, block-size tables, split rule, and the pure-jnp
  references.

Every kernel takes `interpret=` (True runs it on CPU), has a pure-jnp `*_ref` twin in its module, and reads and
writes either one layer's pages [N, ps, Hkv, D] or all layers' stacked [L, N, ps, Hkv, D] at `layer=` (in place).
The trash page is a parameter: this package depends on jax only, not on the application
(`recguide_jax.attention_dispatch` picks between kernels and reference for the model).
"""

from pallas_kernels import block_attention_gpu, block_attention_tpu, common, kv_write_gpu, kv_write_tpu

__all__ = ["block_attention_gpu", "block_attention_tpu", "common", "kv_write_gpu", "kv_write_tpu"]
