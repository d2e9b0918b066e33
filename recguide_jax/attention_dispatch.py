"""Choice between the pure-jnp block attention and the Pallas kernels (`pallas_kernels`).

impl:
- "reference": `attention.block_attention_ref` (XLA), everywhere.
- "pallas": the kernel of the platform: Mosaic on TPU, Triton on GPU; on CPU the Triton-variant kernel runs in
  interpret mode (slow, for tests: it checks the kernel's logic, not its speed).
- "auto": "pallas" on GPU/TPU when the kernel supports the shapes, else "reference".
- "pallas_tpu" / "pallas_gpu": force one variant (interpreted off its platform); test and debugging hooks.

The model reads the choice per attention layer from the plain attribute `attention_impl` (set by
`set_attention_impl`, default "reference"), so it is part of the static graph: set it before building a runner.
"""

from __future__ import annotations

import jax

from recguide_jax import attention as attn_lib

IMPLS = ("auto", "reference", "pallas", "pallas_tpu", "pallas_gpu")


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def unsupported(variant: str, q_shape, page_size: int | None) -> str | None:
  """Why the compiled (not interpreted) kernel cannot take these shapes, or None."""
  d = q_shape[-1]
  if variant == "gpu":
    if not (_pow2(d) and d >= 16):
      return f"Triton needs a power-of-two head_dim >= 16, got {d}"
    if page_size is not None and not _pow2(page_size):
      return f"Triton needs a power-of-two page_size, got {page_size}"
  elif page_size is not None and page_size % 8:
    return f"Mosaic wants page_size a multiple of 8, got {page_size}"
  return None


def resolve(impl: str, q_shape=(1, 1, 1, 128), page_size: int | None = None,
            platform: str | None = None) -> tuple[str, str | None, bool]:
  """-> (path, variant, interpret): path "reference" or "pallas"; variant "tpu"/"gpu" for pallas."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
  platform = platform or jax.default_backend()
  on_accel = platform in ("tpu", "gpu", "cuda", "rocm")
  native = "tpu" if platform == "tpu" else "gpu"
  if impl == "reference" or (impl == "auto" and not on_accel):
    return "reference", None, False
  variant = impl.removeprefix("pallas_") if impl.startswith("pallas_") else native
  interpret = not on_accel or variant != native
  if not interpret:
    why = unsupported(variant, q_shape, page_size)
    if why and impl == "auto":
      return "reference", None, False
    if why:
      raise ValueError(f"attention impl {impl!r}: {why}")
  return "pallas", variant, interpret


def block_attention(q: jax.Array, k_block: jax.Array, v_block: jax.Array, block_mask: jax.Array, *,
                    k_pages: jax.Array | None, v_pages: jax.Array | None, page_table: jax.Array | None,
                    prefix_len: jax.Array | None, scale: float, impl: str = "reference",
                    layer: jax.Array | int | None = None) -> jax.Array:
  """`attention.block_attention_ref`'s contract, computed by the implementation `impl` resolves to. With `layer`
  (an int or the scan's int32 layer index) the pages are every layer's [L, num_pages, page_size, Hkv, D] and both
  paths read that layer's pages in place (never a per-layer slice, which would copy the layer)."""
  page_size = k_pages.shape[-3] if (k_pages is not None and page_table is not None) else None
  path, variant, interpret = resolve(impl, q.shape, page_size)
  kwargs = dict(k_pages=k_pages, v_pages=v_pages, page_table=page_table, prefix_len=prefix_len, scale=scale,
                layer=layer)
  if path == "reference":
    return attn_lib.block_attention_ref(q, k_block, v_block, block_mask, **kwargs)
  # imported here: Pallas (and its backends) load only when a kernel is wanted
  if variant == "tpu":
    from pallas_kernels import block_attention_tpu as kernel
  else:
    from pallas_kernels import block_attention_gpu as kernel
  return kernel.block_attention(q, k_block, v_block, block_mask, interpret=interpret, **kwargs)


def set_attention_impl(model, impl: str) -> None:
  """Sets `attention_impl` on every attention layer of an `NLDModel` (before `nnx.split` / building a runner)."""
  resolve(impl)  # validate the name early
  # one scanned layer module holds every layer (stacked weights): its attribute is the static choice of all layers
  model.layers.self_attn.attention_impl = impl
