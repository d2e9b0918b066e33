"""A model's parameters as flat {dotted name: array}: the names checkpoints, sharding rules and adapters use."""
from __future__ import annotations


def flatten_params(tree: dict, prefix: str = "") -> dict[str, object]:
  """{"a": {"b": x}} -> {"a.b": x} (e.g. of `nnx.state(model, nnx.Param).to_pure_dict()`)."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten_params(value, name + "."))
    else:
      out[name] = value
  return out


def unflatten_params(template: dict, flat: dict[str, object], prefix: str = "") -> dict:
  """The nested dict shaped as `template` whose leaves are `flat`'s entries of the same names."""
  return {key: unflatten_params(value, flat, f"{prefix}{key}.") if isinstance(value, dict) else flat[f"{prefix}{key}"]
          for key, value in template.items()}
