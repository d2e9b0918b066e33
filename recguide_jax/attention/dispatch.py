"""Choice between the pure-jnp block attention and the Pallas kernels (`pallas_kernels`).

impl:
- "reference": XLA, everywhere: `live_attention.block_attention`, which reads the paged prefix in chunks up to the
  batch's longest live prefix (the same result as the full-gather `attention.block_attention_ref`, the kernels'
  reference twin, at a cost that follows the context instead of `max_model_len`).
- "pallas": the kernel of the platform: Mosaic on TPU, Triton on GPU; on CPU the Triton-variant kernel runs in
  interpret mode (slow, for tests: it checks the kernel's logic, not its speed).
- "auto": "pallas" on GPU/TPU when the kernel supports the shapes, else "reference".
- "pallas_tpu" / "pallas_gpu": force one variant (interpreted off its platform); test and debugging hooks.

Under a tensor-parallel mesh (a step traced inside `jax.set_mesh` with tp > 1) the Pallas kernels run per shard:
`shard_map` over the tp axis hands each device its own query heads, its own KV heads of the block and of the pages
(sharding.py puts them there), and the replicated page tables; a kernel needs nothing from other devices, so no
collective runs inside. The reference path is plain jnp and GSPMD partitions it like the rest of the step.

The model reads the choice per attention layer from the plain attribute `attention_impl` (set by
`set_attention_impl`, default "reference"), so it is part of the static graph: set it before building a runner.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from recguide_jax.cache import kv_cache
from recguide_jax.attention import paged as live_attention
from recguide_jax.parallel import sharding

IMPLS = ("auto", "reference", "pallas", "pallas_tpu", "pallas_gpu")

# the platform `resolve` assumes while tracing for another one (`target_platform`); None: jax's default backend
_target_platform: contextvars.ContextVar[str | None] = contextvars.ContextVar("target_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: str | None):
  """Resolve kernels for `platform` ("tpu", "cuda") while tracing here, e.g. to lower a sharded step for a TPU
  from a CPU host (`.trace(...).lower(lowering_platforms=...)`): the native kernels, not interpreted ones."""
  token = _target_platform.set(platform)
  try:
    yield
  finally:
    _target_platform.reset(token)


def tracing_platform() -> str:
  """The platform the step being traced will run on: `target_platform`'s, else jax's default backend."""
  return _target_platform.get() or jax.default_backend()


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def unsupported(variant: str, q_shape, page_size: int | None, page_lanes: int | None = None) -> str | None:
  """Why the compiled (not interpreted) kernel cannot take these shapes, or None. `page_lanes`: the last dim of one
  device's pages (its KV heads * head_dim)."""
  d = q_shape[-1]
  if variant == "gpu":
    if not (_pow2(d) and d >= 16):
      return f"Triton needs a power-of-two head_dim >= 16, got {d}"
    if page_size is not None and not _pow2(page_size):
      return f"Triton needs a power-of-two page_size, got {page_size}"
  elif page_size is not None and page_size % 8:
    return f"Mosaic wants page_size a multiple of 8, got {page_size}"
  elif page_lanes is not None and page_lanes % 128:
    # narrower pages get a TPU layout other than the kernel's row-major one: XLA would copy the cache every call
    return f"Mosaic wants a device's KV heads * head_dim a multiple of 128 lanes, got {page_lanes}"
  return None


def resolve(impl: str, q_shape=(1, 1, 1, 128), page_size: int | None = None,
            platform: str | None = None, page_lanes: int | None = None) -> tuple[str, str | None, bool]:
  """-> (path, variant, interpret): path "reference" or "pallas"; variant "tpu"/"gpu" for pallas."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
  platform = platform or tracing_platform()
  on_accel = platform in ("tpu", "gpu", "cuda", "rocm")
  native = "tpu" if platform == "tpu" else "gpu"
  if impl == "reference" or (impl == "auto" and not on_accel):
    return "reference", None, False
  variant = impl.removeprefix("pallas_") if impl.startswith("pallas_") else native
  interpret = not on_accel or variant != native
  if not interpret:
    why = unsupported(variant, q_shape, page_size, page_lanes)
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
  (an int or the scan's int32 layer index) the pages are every layer's [L, num_pages, page_size, Hkv * D] and both
  paths read that layer's pages in place (never a per-layer slice, which would copy the layer)."""
  paged = k_pages is not None and page_table is not None
  page_size = k_pages.shape[-2] if paged else None
  mesh = sharding.active_mesh()
  tp = sharding.mesh_size(mesh, sharding.TP) if mesh is not None else 1
  path, variant, interpret = resolve(impl, q.shape, page_size, page_lanes=k_pages.shape[-1] // tp if paged else None)
  kwargs = dict(k_pages=k_pages, v_pages=v_pages, page_table=page_table, prefix_len=prefix_len, scale=scale,
                layer=layer)
  if path == "reference":
    return live_attention.block_attention(q, k_block, v_block, block_mask, **kwargs)
  if k_pages is not None and kv_cache.holds_bits(k_pages.dtype):
    # a CPU cache of raw bits (kv_cache.storage_dtype) reaches a kernel only when interpreted on the CPU (tests,
    # debugging): view all of it as the float it holds, a copy the native kernels never make
    kwargs.update(k_pages=kv_cache.from_storage(k_pages, k_block.dtype),
                  v_pages=kv_cache.from_storage(v_pages, v_block.dtype))
  # imported here: Pallas (and its backends) load only when a kernel is wanted
  if variant == "tpu":
    from pallas_kernels import block_attention_tpu as kernel
  else:
    from pallas_kernels import block_attention_gpu as kernel
  if tp > 1:
    return _per_shard(kernel.block_attention, mesh, q, k_block, v_block, block_mask, interpret=interpret, **kwargs)
  return kernel.block_attention(q, k_block, v_block, block_mask, interpret=interpret, **kwargs)


def _per_shard(kernel, mesh, q, k_block, v_block, block_mask, *, k_pages, v_pages, page_table, prefix_len, scale,
               layer, interpret):
  """`kernel` (a Pallas block attention) once per tp shard over its local heads, under `shard_map`."""
  from pallas_kernels import common
  kind = common.mask_kind_of(block_mask)  # before tracing: a concrete causal/full mask keeps the cheap iota path
  heads = P(None, None, sharding.TP, None)
  names, args, specs = [], [], []

  def add(name, value, spec):
    if value is not None and not isinstance(value, (int, str)):
      names.append(name)
      args.append(value)
      specs.append(spec)

  add("q", q, heads)
  add("k_block", k_block, heads)
  add("v_block", v_block, heads)
  if kind == "tree":
    add("block_mask", block_mask, P())
  if page_table is not None:
    pages = P(*(None,) * (k_pages.ndim - 1), sharding.TP)  # [(L,) N, page_size, Hkv * D]: whole KV heads split
    add("k_pages", k_pages, pages)
    add("v_pages", v_pages, pages)
    add("page_table", page_table, P())
    add("prefix_len", prefix_len, P())
    add("layer", layer, P())
  fixed = dict(block_mask=kind if kind != "tree" else None, k_pages=None, v_pages=None, page_table=None,
               prefix_len=None, layer=layer if isinstance(layer, int) else None)

  def local(*values):
    kw = {**fixed, **dict(zip(names, values))}
    return kernel(kw.pop("q"), kw.pop("k_block"), kw.pop("v_block"), kw.pop("block_mask"), scale=scale,
                  interpret=interpret, **kw)

  return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False)(*args)


def set_attention_impl(model, impl: str) -> None:
  """Sets `attention_impl` on every attention layer of an `NLDModel` (before `nnx.split` / building a runner)."""
  resolve(impl)  # validate the name early
  # a scanned model has one layer module for every layer (stacked weights): its attribute is the choice of all;
  # an unrolled one (LayerLoop.UNROLLED) has a module per layer
  for layer in (model.layers if isinstance(model.layers, nnx.List) else [model.layers]):
    layer.self_attn.attention_impl = impl
