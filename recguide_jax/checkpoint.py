"""Our checkpoint format: a directory with `config.json` (HF-style NLD config), `params/` (an orbax checkpoint of a
flat {dotted.name: array} dict) and the tokenizer files. `load_model(dir)` is the one call that turns it into a
ready `NLDModel`."""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from recguide_jax.config import NLDConfig
from recguide_jax.model import NLDModel

PARAMS_DIR = "params"
CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class CheckpointError(ValueError):
  """A checkpoint directory is incomplete or does not match its config; the message names the file or tensor."""


def flatten_params(tree: dict, prefix: str = "") -> dict[str, object]:
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten_params(value, name + "."))
    else:
      out[name] = value
  return out


def _unflatten_into(template: dict, flat: dict[str, object], prefix: str = "") -> dict:
  out = {}
  for key, value in template.items():
    name = f"{prefix}{key}"
    out[key] = _unflatten_into(value, flat, name + ".") if isinstance(value, dict) else flat[name]
  return out


def param_shapes(cfg: NLDConfig, param_dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
  """The flat {name: ShapeDtypeStruct} every checkpoint of `cfg` must hold (computed without allocating)."""
  abstract = nnx.eval_shape(lambda: NLDModel(cfg, dtype=param_dtype, param_dtype=param_dtype))
  return flatten_params(nnx.state(abstract, nnx.Param).to_pure_dict())


def save_params(directory: str | os.PathLike, flat: dict[str, np.ndarray | jax.Array]) -> None:
  path = pathlib.Path(directory).absolute() / PARAMS_DIR
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, dict(flat), force=True)


def save_model(directory: str | os.PathLike, model: NLDModel) -> None:
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  model.cfg.save_json(directory / CONFIG_FILE)
  save_params(directory, flatten_params(nnx.state(model, nnx.Param).to_pure_dict()))


def load_model(directory: str | os.PathLike, *, dtype: str | None = None) -> NLDModel:
  """Loads `config.json` + orbax params into an `NLDModel`. `dtype` overrides the stored dtype (e.g. bfloat16)."""
  directory = pathlib.Path(directory)
  if not (directory / CONFIG_FILE).exists():
    raise CheckpointError(f"{directory} has no {CONFIG_FILE}")
  if not (directory / PARAMS_DIR).exists():
    raise CheckpointError(f"{directory} has no {PARAMS_DIR}/ (run launch/convert_checkpoint.py first)")
  cfg = NLDConfig.from_json_file(directory / CONFIG_FILE)
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(directory.absolute() / PARAMS_DIR)
    stored = meta.item_metadata if hasattr(meta, "item_metadata") else meta
    first = next(iter(stored.values()))
    stored_dtype = jnp.dtype(first.dtype)
    target = jnp.dtype(DTYPES[dtype]) if dtype else stored_dtype
    expected = param_shapes(cfg, stored_dtype)
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing:
      raise CheckpointError(f"checkpoint {directory} is missing tensor '{missing[0]}' ({len(missing)} missing)")
    if unexpected:
      raise CheckpointError(f"checkpoint {directory} has unexpected tensor '{unexpected[0]}'")
    for name, sds in expected.items():
      if tuple(stored[name].shape) != tuple(sds.shape):
        raise CheckpointError(f"tensor '{name}' has shape {tuple(stored[name].shape)}, config implies {sds.shape}")
    flat = ckptr.restore(directory.absolute() / PARAMS_DIR, expected)
  model = nnx.eval_shape(lambda: NLDModel(cfg, dtype=target, param_dtype=target))
  state = nnx.state(model, nnx.Param)
  pure = _unflatten_into(state.to_pure_dict(), {k: jnp.asarray(v, target) for k, v in flat.items()})
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(model, state)
  return model
