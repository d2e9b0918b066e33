"""Our checkpoint format: a directory with `config.json` (HF-style NLD config), `params/` (an orbax checkpoint of a
flat {dotted.name: array} dict) and the tokenizer files. `load_model(dir)` is the one call that turns it into a
ready `NLDModel`.

Layout: the decoder layers are stacked, one tensor per parameter with a leading layer axis
(`layers.self_attn.q_proj.kernel` is [L, hidden, heads * head_dim]), which is what the scanned model holds.
Checkpoints written before the stack (one tensor per layer, `layers.0.self_attn.q_proj.kernel`, ...) still load:
their per-layer tensors are stacked on load.

Restores always land on the devices of the running process: `load_model(..., sharding=...)` takes the target
(default: the default device), and every tensor is restored with an explicit target sharding. The device recorded
at save time (a checkpoint saved from arrays on `cpu:0`, say) is never used, so a checkpoint moves between hosts,
platforms and device counts unchanged.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Callable, Mapping, Union

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from recguide_jax.model.config import NLDConfig
from recguide_jax.model.nld import (KernelLayout, LayerLoop, NLDModel, ProjectionFusion, model_from_params,
                                    with_kernel_layout, with_layer_loop, with_projection_fusion)
from recguide_jax.model.params import flatten_params

PARAMS_DIR = "params"
CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
LAYERS_PREFIX = "layers."  # stacked per-layer parameters: `layers.<suffix>` with a leading [L] axis

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Where restored tensors go: one sharding for every tensor (e.g. a device), a {name: sharding} mapping, or a
# function of (name, shape) -> sharding (how a mesh will place each tensor: NamedShardings by name and shape).
ShardingSpec = Union[jax.sharding.Sharding, Mapping[str, jax.sharding.Sharding],
                     Callable[[str, tuple[int, ...]], jax.sharding.Sharding], None]

_LEGACY_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


class CheckpointError(ValueError):
  """A checkpoint directory is incomplete or does not match its config; the message names the file or tensor."""


def param_shapes(cfg: NLDConfig, param_dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
  """The flat {name: ShapeDtypeStruct} every checkpoint of `cfg` must hold (computed without allocating). Layer
  parameters are stacked: `layers.<suffix>` has shape [num_hidden_layers, ...]."""
  abstract = nnx.eval_shape(lambda: NLDModel(cfg, dtype=param_dtype, param_dtype=param_dtype))
  return flatten_params(nnx.state(abstract, nnx.Param).to_pure_dict())


def legacy_param_shapes(cfg: NLDConfig, param_dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
  """The names and shapes of the old per-layer layout (`layers.<i>.<suffix>`, no layer axis)."""
  out = {}
  for name, sds in param_shapes(cfg, param_dtype).items():
    if name.startswith(LAYERS_PREFIX):
      suffix = name[len(LAYERS_PREFIX):]
      for i in range(cfg.num_hidden_layers):
        out[f"{LAYERS_PREFIX}{i}.{suffix}"] = jax.ShapeDtypeStruct(sds.shape[1:], sds.dtype)
    else:
      out[name] = sds
  return out


def is_legacy_layout(names) -> bool:
  """True for a checkpoint written before the layer stack (per-layer tensors `layers.<i>.<suffix>`)."""
  return any(_LEGACY_LAYER.match(n) for n in names)


def stack_legacy(flat: Mapping[str, object], num_layers: int) -> dict[str, object]:
  """Per-layer tensors `layers.<i>.<suffix>` -> stacked `layers.<suffix>` [num_layers, ...]; others unchanged.
  Raises CheckpointError naming the first missing layer tensor."""
  out, per_suffix = {}, {}
  for name, value in flat.items():
    m = _LEGACY_LAYER.match(name)
    if m:
      per_suffix.setdefault(m.group(2), {})[int(m.group(1))] = value
    else:
      out[name] = value
  for suffix, layers in per_suffix.items():
    for i in range(num_layers):
      if i not in layers:
        raise CheckpointError(f"checkpoint is missing tensor '{LAYERS_PREFIX}{i}.{suffix}'")
    parts = [layers[i] for i in range(num_layers)]
    stack = jnp.stack if isinstance(parts[0], jax.Array) else np.stack
    out[LAYERS_PREFIX + suffix] = stack(parts)
  return out


def default_sharding() -> jax.sharding.Sharding:
  """The running process's default device (`jax.default_device(...)` if one is set, else the first device)."""
  dev = jax.config.jax_default_device
  if isinstance(dev, str):  # a platform name
    dev = jax.devices(dev)[0]
  return jax.sharding.SingleDeviceSharding(dev if dev is not None else jax.devices()[0])


def sharding_for(spec: ShardingSpec, name: str, shape: tuple[int, ...]) -> jax.sharding.Sharding:
  """The target sharding of tensor `name` under `spec` (see `ShardingSpec`)."""
  if spec is None:
    return default_sharding()
  if isinstance(spec, jax.sharding.Sharding):
    return spec
  if isinstance(spec, Mapping):
    if name not in spec:
      raise CheckpointError(f"no target sharding given for tensor '{name}'")
    return spec[name]
  return spec(name, tuple(shape))


def save_params(directory: str | os.PathLike, flat: dict[str, np.ndarray | jax.Array]) -> None:
  """Writes the flat {name: array} dict to `<directory>/params` (the one save path of conversion, training and
  distillation exports). Where the arrays live does not matter: restores never use the recorded devices."""
  path = pathlib.Path(directory).absolute() / PARAMS_DIR
  # Single-device arrays are written from host memory, so the files record no device at all (a sharded array keeps
  # its layout for orbax to write in parallel; its recorded devices are ignored on restore all the same).
  flat = {name: np.asarray(v) if isinstance(v, jax.Array) and len(v.sharding.device_set) == 1 else v
          for name, v in flat.items()}
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, flat, force=True)


def save_model(directory: str | os.PathLike, model: NLDModel) -> None:
  """Writes `model` in the checkpoint form (stacked layers, separate projections, [in, out] kernels), however the
  runner arranged it."""
  separate = with_projection_fusion(with_layer_loop(model, LayerLoop.SCAN), ProjectionFusion.SEPARATE)
  model = with_kernel_layout(separate, KernelLayout.IN_OUT)
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  model.cfg.save_json(directory / CONFIG_FILE)
  save_params(directory, flatten_params(nnx.state(model, nnx.Param).to_pure_dict()))


def restore_params(path: str | os.PathLike, shapes: Mapping[str, jax.ShapeDtypeStruct],
                   sharding: ShardingSpec = None) -> dict[str, jax.Array]:
  """Restores the tensors `shapes` names from the orbax checkpoint at `path` onto `sharding`'s devices (never the
  devices recorded at save time)."""
  target = {name: jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sharding_for(sharding, name, sds.shape))
            for name, sds in shapes.items()}
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(pathlib.Path(path).absolute(), target)


def _check_tensors(directory, stored: Mapping, expected: Mapping[str, jax.ShapeDtypeStruct]) -> None:
  missing = sorted(set(expected) - set(stored))
  unexpected = sorted(set(stored) - set(expected))
  if missing:
    raise CheckpointError(f"checkpoint {directory} is missing tensor '{missing[0]}' ({len(missing)} missing)")
  if unexpected:
    raise CheckpointError(f"checkpoint {directory} has unexpected tensor '{unexpected[0]}'")
  for name, sds in expected.items():
    if tuple(stored[name].shape) != tuple(sds.shape):
      raise CheckpointError(f"tensor '{name}' has shape {tuple(stored[name].shape)}, config implies {sds.shape}")


def load_params(directory: str | os.PathLike, cfg: NLDConfig, *,
                sharding: ShardingSpec = None) -> dict[str, jax.Array]:
  """The flat stacked {name: array} of `directory`'s params/, checked against `cfg`, restored onto `sharding`
  (default: the default device) in the stored dtype. Per-layer (pre-stack) checkpoints are stacked on load."""
  directory = pathlib.Path(directory)
  path = directory.absolute() / PARAMS_DIR
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(path)
  stored = meta.item_metadata if hasattr(meta, "item_metadata") else meta
  if not stored:
    raise CheckpointError(f"{path} holds no tensors")
  stored_dtype = jnp.dtype(next(iter(stored.values())).dtype)
  if not is_legacy_layout(stored):
    expected = param_shapes(cfg, stored_dtype)
    _check_tensors(directory, stored, expected)
    return restore_params(path, expected, sharding)
  # Pre-stack checkpoint: restore its per-layer tensors onto the target devices, then stack them there.
  legacy = legacy_param_shapes(cfg, stored_dtype)
  _check_tensors(directory, stored, legacy)
  stacked_shapes = param_shapes(cfg, stored_dtype)

  def layer_sharding(name, shape):  # a layer's tensor goes where its stack will live (its target, minus dim 0)
    m = _LEGACY_LAYER.match(name)
    if not m:
      return sharding_for(sharding, name, shape)
    stacked_name = LAYERS_PREFIX + m.group(2)
    target = sharding_for(sharding, stacked_name, stacked_shapes[stacked_name].shape)
    return target if isinstance(target, jax.sharding.SingleDeviceSharding) else default_sharding()

  flat = stack_legacy(restore_params(path, legacy, layer_sharding), cfg.num_hidden_layers)
  return {name: jax.device_put(value, sharding_for(sharding, name, value.shape)) for name, value in flat.items()}


def load_model(directory: str | os.PathLike, *, dtype: str | None = None,
               sharding: ShardingSpec = None, mesh: jax.sharding.Mesh | None = None) -> NLDModel:
  """Loads `config.json` + orbax params into an `NLDModel` whose weights live on `sharding` (default: the default
  device; a per-tensor mapping or function, see `ShardingSpec`). `dtype` overrides the stored dtype (e.g.
  bfloat16).

  `mesh`: restore every tensor straight into its shards by sharding.py's rules (orbax reads only the slices each
  process's devices hold; no tensor is assembled whole on one device or host), then replicate the KV heads where
  tp exceeds them (the returned model's config says so; see `sharding.mesh_config`)."""
  if mesh is not None:
    if sharding is not None:
      raise ValueError("load_model: pass `sharding` or `mesh`, not both")
    from recguide_jax.parallel import sharding as sharding_lib
    directory = pathlib.Path(directory)
    if not (directory / CONFIG_FILE).exists():
      raise CheckpointError(f"{directory} has no {CONFIG_FILE}")
    if dtype is not None and dtype not in DTYPES:
      raise CheckpointError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cfg = NLDConfig.from_json_file(directory / CONFIG_FILE)
    sharding_lib.check_model(cfg, sharding_lib.mesh_size(mesh, sharding_lib.TP))  # before reading anything
    flat = load_params(directory, cfg, sharding=sharding_lib.param_sharding_fn(mesh))
    target = jnp.dtype(DTYPES[dtype]) if dtype else jnp.dtype(next(iter(flat.values())).dtype)
    flat = {k: v if v.dtype == target else v.astype(target) for k, v in flat.items()}  # cast in place, per shard
    run_cfg, placed = sharding_lib.place_params(flat, cfg, mesh)
    return model_from_params(run_cfg, placed, dtype=target)
  directory = pathlib.Path(directory)
  if not (directory / CONFIG_FILE).exists():
    raise CheckpointError(f"{directory} has no {CONFIG_FILE}")
  if not (directory / PARAMS_DIR).exists():
    raise CheckpointError(f"{directory} has no {PARAMS_DIR}/ (run launch/convert_checkpoint.py first)")
  if dtype is not None and dtype not in DTYPES:
    raise CheckpointError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  cfg = NLDConfig.from_json_file(directory / CONFIG_FILE)
  flat = load_params(directory, cfg, sharding=sharding)
  target = jnp.dtype(DTYPES[dtype]) if dtype else jnp.dtype(next(iter(flat.values())).dtype)
  # the cast runs where each tensor already lives (astype keeps the sharding)
  return model_from_params(cfg, {k: v if v.dtype == target else v.astype(target) for k, v in flat.items()},
                           dtype=target)
