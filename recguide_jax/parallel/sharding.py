"""Meshes and sharding rules: where every weight, KV page and activation lives on a `dp` x `tp` device mesh.

The engine's parallelism is JAX's own SPMD: the weights are `NamedSharding`s on a `jax.sharding.Mesh`, every step is
one `jax.jit` program with explicit in/out shardings, and XLA's SPMD partitioner (GSPMD) inserts the collectives.
Only the Pallas attention kernels, which GSPMD cannot partition, run per shard under `shard_map`
(attention_dispatch.py).

Mesh axes:
- `dp` (data parallel): replicas. Each dp group holds a whole copy of the weights and its own KV pages, on its own
  `tp` sub-mesh (`replica_meshes`); requests are assigned to groups by data_parallel.py ("one step per group").
- `tp` (tensor parallel, Megatron style): inside a group, attention heads and MLP columns are split over `tp`.

Rules, MaxText-style: every parameter dimension has a logical axis name (`PARAM_AXES`), and `LOGICAL_RULES` maps
logical names to mesh axes. A logical axis whose size the mesh axis does not divide stays replicated (named in
`sharding_report`), so a rule table can never produce an invalid sharding.

- q/k/v projections: columns (heads) over tp; o_proj: rows (heads) over tp, so attention needs one all-reduce
  after o_proj per layer and nothing before it (each device attends its own heads over its own KV pages).
- MLP: gate/up columns and down rows over tp: one all-reduce after down_proj.
- Draft LoRA (`<proj>.lora_a` [in, r], `.lora_b` [r, out]): each factor's in/out dims follow its projection's
  (o_proj's and down_proj's lora_a rows over tp: a partial sum reduced with the projection's; q/k/v/gate/up's
  lora_b columns over tp, like their outputs); the rank axis is replicated.
- The embedding and the diffusion head: over the vocabulary. For the head this is what the profile favours: the
  head is the largest single matmul of a decode step (hidden x 131k for NLD) and with its columns split the logits
  stay vocab-sharded through the softmax/argmax/entropy reductions (which exchange [b, Q] statistics), whereas a
  hidden-sharded head would all-reduce the full [b, Q, V] float32 logits every step. The embedding follows the same
  vocab axis (a masked local lookup plus an all-reduce of [b, Q, hidden], as MaxText's vocab-parallel embedding), so
  both tables take 1/tp of the memory each.
- KV pages [L, pages, page_size, kv_heads * head_dim]: whole kv heads over tp (the folded last dim, head-major). With more tp devices than KV heads (NLD's
  8 KV heads on 16 chips) the heads are replicated in groups first (`kv_replication`; each device then holds one
  whole head), as vLLM / tpu-inference / sglang-jax do: GQA maps query head j to KV head j // (q_heads / kv_heads),
  and repeating every KV head r times keeps that mapping exact with q_heads / (kv_heads * r) queries per copy.
- Activations: the residual stream is replicated over tp; q/k/v and attention outputs are head-sharded (`constrain`,
  a no-op outside a mesh); the step's small host inputs and outputs are replicated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DP, TP = "dp", "tp"
MESH_AXES = (DP, TP)

# logical axes of every parameter, by its flat checkpoint name (stacked layer parameters lead with "layers")
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed_tokens.embedding": ("vocab", "embed"),
    "layers.input_layernorm.weight": ("layers", "norm"),
    "layers.self_attn.q_proj.kernel": ("layers", "embed", "q_heads"),
    "layers.self_attn.k_proj.kernel": ("layers", "embed", "kv_heads"),
    "layers.self_attn.v_proj.kernel": ("layers", "embed", "kv_heads"),
    "layers.self_attn.o_proj.kernel": ("layers", "q_heads", "embed"),
    "layers.self_attn.q_proj.lora_a": ("layers", "embed", "lora"),
    "layers.self_attn.q_proj.lora_b": ("layers", "lora", "q_heads"),
    "layers.self_attn.k_proj.lora_a": ("layers", "embed", "lora"),
    "layers.self_attn.k_proj.lora_b": ("layers", "lora", "kv_heads"),
    "layers.self_attn.v_proj.lora_a": ("layers", "embed", "lora"),
    "layers.self_attn.v_proj.lora_b": ("layers", "lora", "kv_heads"),
    "layers.self_attn.o_proj.lora_a": ("layers", "q_heads", "lora"),
    "layers.self_attn.o_proj.lora_b": ("layers", "lora", "embed"),
    "layers.mlp.gate_proj.lora_a": ("layers", "embed", "lora"),
    "layers.mlp.gate_proj.lora_b": ("layers", "lora", "mlp"),
    "layers.mlp.up_proj.lora_a": ("layers", "embed", "lora"),
    "layers.mlp.up_proj.lora_b": ("layers", "lora", "mlp"),
    "layers.mlp.down_proj.lora_a": ("layers", "mlp", "lora"),
    "layers.mlp.down_proj.lora_b": ("layers", "lora", "embed"),
    "layers.post_attention_layernorm.weight": ("layers", "norm"),
    "layers.mlp.gate_proj.kernel": ("layers", "embed", "mlp"),
    "layers.mlp.up_proj.kernel": ("layers", "embed", "mlp"),
    "layers.mlp.down_proj.kernel": ("layers", "mlp", "embed"),
    "norm.weight": ("norm",),
    "diffusion_head.kernel": ("embed", "vocab"),
}

# logical axis -> mesh axis (None: replicated). Weights, then the KV cache, then activations.
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", TP), ("q_heads", TP), ("kv_heads", TP), ("mlp", TP),
    ("embed", None), ("layers", None), ("norm", None), ("lora", None),
    ("cache_layers", None), ("cache_pages", None), ("cache_slots", None), ("cache_kv_heads", TP),
    ("batch", None), ("length", None), ("act_heads", TP), ("act_kv_heads", TP), ("head_dim", None),
    ("act_embed", None),
)
CACHE_AXES = ("cache_layers", "cache_pages", "cache_slots", "cache_kv_heads")  # the last: kv_heads * head_dim


class MeshError(ValueError):
  """A mesh spec or shape the model or the devices cannot take; the message names the flag and the numbers."""


# ---- mesh shape and construction ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MeshShape:
  dp: int = 1
  tp: int = 1

  def __post_init__(self):
    for name in MESH_AXES:
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise MeshError(f"--mesh: {name} must be a positive integer, got {v!r}")

  @property
  def size(self) -> int:
    return self.dp * self.tp

  def __str__(self) -> str:
    return f"dp={self.dp},tp={self.tp}"


def parse_mesh(spec: str | None) -> MeshShape:
  """'dp=2,tp=4' (either order, either part optional; '' or None: one device) -> MeshShape."""
  if not spec:
    return MeshShape()
  sizes = {}
  for part in spec.replace(" ", "").split(","):
    m = re.fullmatch(r"([a-z]+)=(\d+)", part)
    if not m:
      raise MeshError(f"--mesh: expected 'dp=N,tp=M', got {spec!r} (bad part {part!r})")
    name, value = m.group(1), int(m.group(2))
    if name not in MESH_AXES:
      raise MeshError(f"--mesh: unknown axis {name!r} in {spec!r}; axes are {', '.join(MESH_AXES)}")
    if name in sizes:
      raise MeshError(f"--mesh: axis {name!r} given twice in {spec!r}")
    sizes[name] = value
  return MeshShape(**sizes)


def make_mesh(shape: MeshShape, devices: Sequence | None = None) -> Mesh:
  """A (dp, tp) mesh over the first shape.size of `devices` (default: every device of every process, in jax's
  order, so a tp group is the fastest-connected neighbours `jax.make_mesh` picks). Auto axes: GSPMD propagates
  shardings between the annotated weights, cache and inputs."""
  devices = list(jax.devices() if devices is None else devices)
  if shape.size > len(devices):
    raise MeshError(f"--mesh {shape} needs {shape.size} devices, {len(devices)} are available")
  auto = (jax.sharding.AxisType.Auto,) * 2
  if len(devices) == len(jax.devices()) and shape.size == len(devices):
    try:  # the topology-aware device order (ICI rings on TPU, NVLink groups on GPU)
      return jax.make_mesh((shape.dp, shape.tp), MESH_AXES, axis_types=auto, devices=devices)
    except Exception:  # noqa: BLE001 - odd topologies: fall back to the plain order below
      pass
  grid = np.asarray(devices[:shape.size], dtype=object).reshape(shape.dp, shape.tp)
  return Mesh(grid, MESH_AXES, axis_types=auto)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
  """One (1, tp) sub-mesh per dp group: the devices one replica's weights, KV pages and steps live on."""
  grid = mesh.devices
  return [Mesh(grid[i:i + 1], MESH_AXES, axis_types=mesh.axis_types) for i in range(grid.shape[0])]


def abstract_mesh(shape: MeshShape) -> jax.sharding.AbstractMesh:
  """A device-free mesh of `shape`, for lowering for a platform this host does not have."""
  return jax.sharding.AbstractMesh((shape.dp, shape.tp), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_platform(mesh) -> str | None:
  """The platform of a mesh's devices, compile-only ones included (what its variants compile for); None without a
  mesh or for an AbstractMesh (it lowers for a platform named then)."""
  try:
    return mesh.devices.flat[0].platform if mesh is not None else None
  except ValueError:
    return None


def mesh_size(mesh, axis: str) -> int:
  if mesh is None or mesh.empty or axis not in mesh.axis_names:
    return 1
  return dict(zip(mesh.axis_names, mesh.axis_sizes))[axis]


# ---- model shapes on a mesh -----------------------------------------------------------------------------------------

def kv_replication(num_kv_heads: int, tp: int) -> int:
  """How many copies of each KV head a tp group holds: 1 when tp divides the heads, tp / heads when the heads
  divide tp (each device then holds one whole head). Anything else is refused."""
  if tp < 1:
    raise MeshError(f"--tensor_parallel_size must be >= 1, got {tp}")
  if tp <= num_kv_heads:
    if num_kv_heads % tp:
      raise MeshError(f"--tensor_parallel_size {tp} must divide the model's {num_kv_heads} KV heads (or be a "
                      "multiple of them)")
    return 1
  if tp % num_kv_heads:
    raise MeshError(f"--tensor_parallel_size {tp} must be a multiple of the model's {num_kv_heads} KV heads (or divide them)")
  return tp // num_kv_heads


def check_model(cfg, tp: int) -> None:
  """Refuses a tp the model's heads or MLP cannot be split over, naming the numbers."""
  r = kv_replication(cfg.num_key_value_heads, tp)
  if cfg.num_attention_heads % tp:
    raise MeshError(f"--tensor_parallel_size {tp} must divide the model's {cfg.num_attention_heads} attention heads")
  if cfg.intermediate_size % tp:
    raise MeshError(f"--tensor_parallel_size {tp} must divide the model's intermediate_size {cfg.intermediate_size}")
  if cfg.num_attention_heads % (cfg.num_key_value_heads * r):
    raise MeshError(f"--tensor_parallel_size {tp}: {cfg.num_attention_heads} attention heads cannot be grouped over "
                    f"{cfg.num_key_value_heads * r} replicated KV heads")


def mesh_config(cfg, tp: int):
  """The config the model runs with on a tp group: the same model with its KV heads replicated `kv_replication`
  times when tp exceeds them (an exactly equivalent GQA model, see the module doc); otherwise `cfg` itself."""
  check_model(cfg, tp)
  r = kv_replication(cfg.num_key_value_heads, tp)
  return cfg if r == 1 else cfg.replace(num_key_value_heads=cfg.num_key_value_heads * r)


def replicate_kv_heads(kernel, num_kv_heads: int, head_dim: int, r: int):
  """A k/v projection kernel [..., hidden, kv_heads * head_dim] with every head repeated r times in place
  (head h -> heads h*r .. h*r + r - 1), as `mesh_config` expects."""
  import jax.numpy as jnp
  if r == 1:
    return kernel
  lead = kernel.shape[:-1]
  heads = kernel.reshape(*lead, num_kv_heads, head_dim)
  return jnp.repeat(heads, r, axis=-2).reshape(*lead, num_kv_heads * r * head_dim)


# the weights whose last dim is kv_heads * head_dim (a draft LoRA's lora_b included): replicated with the heads
KV_PROJECTIONS = ("layers.self_attn.k_proj.kernel", "layers.self_attn.v_proj.kernel",
                  "layers.self_attn.k_proj.lora_b", "layers.self_attn.v_proj.lora_b")


# ---- rules -> PartitionSpecs ----------------------------------------------------------------------------------------

def logical_to_mesh(logical: Sequence[str | None], shape: Sequence[int] | None = None, mesh=None,
                    rules: Sequence[tuple[str, str | None]] = LOGICAL_RULES) -> P:
  """PartitionSpec of an array with these logical axes. With `shape` and `mesh`, an axis the mesh axis does not
  divide is left replicated (so the spec is always valid), and a mesh axis is used at most once."""
  table = dict(rules)
  used, out = set(), []
  for i, name in enumerate(logical):
    axis = table.get(name) if name is not None else None
    if axis is not None and (axis in used or (shape is not None and mesh is not None and
                                              shape[i] % mesh_size(mesh, axis))):
      axis = None
    if axis is not None:
      used.add(axis)
    out.append(axis)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def param_axes(name: str) -> tuple[str, ...]:
  if name not in PARAM_AXES:
    raise KeyError(f"no sharding rule for parameter '{name}' (add it to sharding.PARAM_AXES)")
  return PARAM_AXES[name]


def param_spec(name: str, shape: Sequence[int], mesh) -> P:
  axes = param_axes(name)
  if len(axes) != len(shape):
    raise ValueError(f"parameter '{name}' has shape {tuple(shape)}, its rule names {len(axes)} axes {axes}")
  return logical_to_mesh(axes, shape, mesh)


def param_sharding_fn(mesh: Mesh) -> Callable[[str, tuple[int, ...]], NamedSharding]:
  """(name, shape) -> NamedSharding: the `sharding` argument of checkpoint.load_model / restore_params, so every
  tensor is restored straight into its shards (each process reads only the slices its devices hold)."""
  return lambda name, shape: NamedSharding(mesh, param_spec(name, shape, mesh))


def _path_name(path) -> str:
  parts = []
  for k in path:
    key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
    if key == "value" and isinstance(k, jax.tree_util.GetAttrKey):
      continue  # nnx.Variable's value attribute
    parts.append(str(key))
  return ".".join(parts)


def state_shardings(state, mesh: Mesh):
  """The NamedSharding pytree of a model state (`nnx.split(model)[1]` or any pytree whose leaf paths spell the
  checkpoint names): parameters by `PARAM_AXES`, anything else replicated."""

  def one(path, leaf):
    name = _path_name(path)
    shape = getattr(leaf, "shape", ())
    if name in PARAM_AXES:
      return NamedSharding(mesh, param_spec(name, shape, mesh))
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(one, state)


def abstract_state(state, mesh) -> object:
  """The state as `jax.ShapeDtypeStruct`s carrying their mesh shardings (lowering from abstract weights; `mesh`
  may be an AbstractMesh)."""
  shardings = state_shardings(state, mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def cache_spec(mesh=None, kv_heads: int | None = None) -> P:
  shape = None if kv_heads is None else (1, 1, 1, kv_heads)  # split by whole heads, so tp must divide the heads
  return logical_to_mesh(CACHE_AXES, shape, mesh)


def cache_sharding(mesh, kv_heads: int | None = None) -> NamedSharding:
  """Where the KV pages [L, pages, page_size, kv_heads * head_dim] live: KV heads over tp (pass the model's
  (replicated) kv_heads so a count tp does not divide stays replicated instead of failing)."""
  return NamedSharding(mesh, cache_spec(mesh, kv_heads))


def replicated(mesh) -> NamedSharding:
  """Small host inputs and outputs of a step (token ids, lengths, page tables, accepted counts)."""
  return NamedSharding(mesh, P())


def step_io_sharding(mesh, shape: Sequence[int], vocab_size: int) -> NamedSharding:
  """Where a step's input or output lives: a [b, T, vocab] distribution (a draft's q, which the next verify reads)
  stays split over the vocabulary like the logits it came from, so a draft never gathers [b, B, V] float32 onto
  every device (1/tp of it each); everything else is small and replicated."""
  if len(shape) == 3 and shape[-1] == vocab_size:
    return NamedSharding(mesh, logical_to_mesh(("batch", "length", "vocab"), shape, mesh))
  return replicated(mesh)


def sharding_report(shapes: Mapping[str, Sequence[int]], mesh) -> dict[str, str]:
  """{name: spec} of every parameter on `mesh` (shows which dims are split and which stay replicated)."""
  return {name: str(param_spec(name, tuple(shape), mesh)) for name, shape in shapes.items()}


# ---- activations ----------------------------------------------------------------------------------------------------

def active_mesh():
  """The mesh the current trace runs under (`jax.set_mesh`), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def constrain(x, *logical: str | None):
  """`with_sharding_constraint` of an activation by logical axes when tracing under a mesh with tp > 1 (set by the
  runner); a no-op otherwise, so the one-device path traces exactly as before."""
  mesh = active_mesh()
  if mesh is None or mesh_size(mesh, TP) == 1:
    return x
  spec = logical_to_mesh(logical, x.shape, mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ---- placing weights ------------------------------------------------------------------------------------------------

def place_params(flat: Mapping[str, jax.Array], cfg, mesh: Mesh) -> tuple[object, dict[str, jax.Array]]:
  """Flat {name: array} of `cfg` (wherever the arrays are: one device, or already in their shards from a sharded
  restore) -> (the config the mesh runs, {name: array on its NamedSharding}). KV projections get their heads
  replicated (`mesh_config`) by one jitted repeat whose output lands in its shards: no array is gathered whole onto
  one device or host on the way."""
  tp = mesh_size(mesh, TP)
  run_cfg = mesh_config(cfg, tp)
  r = run_cfg.num_key_value_heads // cfg.num_key_value_heads
  out = {}
  for name, value in flat.items():
    value = jax.device_put(value, NamedSharding(mesh, param_spec(name, value.shape, mesh)))  # no-op if there
    if name in KV_PROJECTIONS and r > 1:
      shape = value.shape[:-1] + (value.shape[-1] * r,)
      target = NamedSharding(mesh, param_spec(name, shape, mesh))
      expand = jax.jit(lambda k: replicate_kv_heads(k, cfg.num_key_value_heads, cfg.head_dim, r),
                       out_shardings=target)
      out[name] = expand(value)
    else:
      out[name] = value
  return run_cfg, out


def mesh_context(mesh):
  """The context a step is traced in: `jax.set_mesh` for a device mesh, `use_abstract_mesh` for an AbstractMesh
  (lowering for another platform), nothing without a mesh. `constrain` and the per-shard kernels read it."""
  import contextlib
  if mesh is None:
    return contextlib.nullcontext()
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)
