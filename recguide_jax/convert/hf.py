"""Hugging Face NLD checkpoint -> our checkpoint format (config.json + orbax params/ + tokenizer files).

Input: an HF directory with `config.json` and `model.safetensors` (or `model.safetensors.index.json` + shards),
optionally a PEFT draft LoRA directory (`linear_spec_lora/`: `adapter_config.json` + `adapter_model.safetensors`).
Names and layouts follow docs/spec/nld.md §3.2 and §3.3: torch Linear weights [out, in] become Flax kernels [in, out],
the embedding stays [V, H], LoRA A [r, in] / B [out, r] become `lora_a` [in, r] / `lora_b` [r, out]. Per-layer
tensors are written stacked, as the scanned model holds them: HF's `encoder.layers.N.<name>` is row N of our
`layers.<name>` [num_layers, ...].

Everything is validated from the safetensors headers before any tensor is read, so a missing, unexpected or
mis-shaped tensor stops the conversion at once with its HF name in the message, and nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil

import ml_dtypes
import numpy as np
from tqdm import tqdm

from recguide_jax.model.checkpoint import CONFIG_FILE, TOKENIZER_FILES, CheckpointError, param_shapes, save_params
from recguide_jax.model.config import NLDConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LORA_CONFIG_FILE = "adapter_config.json"
LORA_WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_LORA_SUBDIR = "linear_spec_lora"

OUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

# safetensors dtype tags we accept (weights only). We read the raw bytes ourselves because
# `safe_open(framework="numpy")` cannot decode BF16, the dtype of every released NLD checkpoint, and going through
# torch would make torch a serving dependency.
_ST_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
              "BF16": np.dtype(ml_dtypes.bfloat16)}

# HF name -> (our name, transpose). Per-layer entries are suffixes of `encoder.layers.N.` / our stacked `layers.`.
_LAYER_TENSORS = {
    "input_layernorm.weight": ("input_layernorm.weight", False),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", False),
    **{f"self_attn.{p}_proj.weight": (f"self_attn.{p}_proj.kernel", True) for p in "qkvo"},
    **{f"mlp.{p}_proj.weight": (f"mlp.{p}_proj.kernel", True) for p in ("gate", "up", "down")},
}
_GLOBAL_TENSORS = {
    "encoder.embed_tokens.weight": ("embed_tokens.embedding", False),
    "encoder.norm.weight": ("norm.weight", False),
    "diffusion_head.weight": ("diffusion_head.kernel", True),
}
_LORA_TENSORS = {"lora_A": "lora_a", "lora_B": "lora_b"}  # both transposed
_LORA_PREFIX = "base_model.model.encoder.layers"


class ConversionError(CheckpointError):
  """The HF checkpoint cannot be converted; the message names the file or HF tensor at fault."""


@dataclasses.dataclass(frozen=True)
class _TensorRef:
  """Where one tensor lives: file, dtype tag, shape and absolute byte range (from the safetensors header)."""
  name: str
  path: pathlib.Path
  dtype: str
  shape: tuple[int, ...]
  start: int
  end: int


@dataclasses.dataclass(frozen=True)
class _Item:
  ref: _TensorRef
  ours: str
  transpose: bool
  layer: int | None = None  # row of the stacked `ours` (None: a global tensor)


def _read_header(path: pathlib.Path) -> dict[str, _TensorRef]:
  """Parses a safetensors header: 8-byte little-endian length, then a JSON map name -> dtype/shape/offsets."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or n > size - 8:
      raise ConversionError(f"{path} is not a safetensors file (bad header length)")
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConversionError(f"{path} has a corrupt safetensors header: {e}") from e
  base = 8 + n
  refs = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    try:
      start, end = info["data_offsets"]
      ref = _TensorRef(name, path, info["dtype"], tuple(int(s) for s in info["shape"]), base + start, base + end)
    except (KeyError, TypeError, ValueError) as e:
      raise ConversionError(f"tensor '{name}' in {path} has a malformed header entry: {e!r}") from e
    dtype = _ST_DTYPES.get(ref.dtype)
    if dtype is None:
      raise ConversionError(f"tensor '{name}' in {path} has dtype {ref.dtype}; expected one of {sorted(_ST_DTYPES)}")
    if ref.end > size or ref.end - ref.start != math.prod(ref.shape) * dtype.itemsize:
      raise ConversionError(f"tensor '{name}' in {path} has a byte range that does not match its shape "
                            f"{list(ref.shape)} (truncated file?)")
    refs[name] = ref
  return refs


def _read_tensor(ref: _TensorRef) -> np.ndarray:
  with open(ref.path, "rb") as f:
    f.seek(ref.start)
    buf = f.read(ref.end - ref.start)
  if len(buf) != ref.end - ref.start:
    raise ConversionError(f"tensor '{ref.name}' in {ref.path} is truncated")
  return np.frombuffer(buf, dtype=_ST_DTYPES[ref.dtype]).reshape(ref.shape)


def _load_json(path: pathlib.Path) -> dict:
  try:
    with open(path) as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ConversionError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(raw, dict):
    raise ConversionError(f"{path} must hold a JSON object")
  return raw


def _index_tensors(hf_dir: pathlib.Path) -> dict[str, _TensorRef]:
  """All base-model tensors of the checkpoint, from the single file or the sharded index (headers only)."""
  single = hf_dir / SINGLE_FILE
  if single.exists():  # transformers' order too: the single file wins over an index
    return _read_header(single)
  index = hf_dir / INDEX_FILE
  if not index.exists():
    raise ConversionError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
  weight_map = _load_json(index).get("weight_map")
  if not isinstance(weight_map, dict) or not weight_map:
    raise ConversionError(f"{index} has no 'weight_map'")
  shards: dict[str, dict[str, _TensorRef]] = {}
  refs = {}
  # Like transformers, only tensors listed in the weight map count; each must really be in its shard.
  for name, shard in weight_map.items():
    if shard not in shards:
      path = hf_dir / shard
      if not path.exists():
        raise ConversionError(f"shard {shard} (holding tensor '{name}') listed in {INDEX_FILE} does not exist")
      shards[shard] = _read_header(path)
    if name not in shards[shard]:
      raise ConversionError(f"tensor '{name}' is listed under {shard} in {INDEX_FILE} but that shard lacks it")
    refs[name] = shards[shard][name]
  return refs


def _base_names(cfg: NLDConfig) -> dict[str, tuple[str, bool, int | None]]:
  """HF name -> (our stacked name, transpose, layer row or None)."""
  names = {hf: (ours, transpose, None) for hf, (ours, transpose) in _GLOBAL_TENSORS.items()}
  for i in range(cfg.num_hidden_layers):
    for hf, (ours, transpose) in _LAYER_TENSORS.items():
      names[f"encoder.layers.{i}.{hf}"] = (f"layers.{ours}", transpose, i)
  return names


def _lora_names(cfg: NLDConfig) -> dict[str, tuple[str, bool, int | None]]:
  return {f"{_LORA_PREFIX}.{i}.self_attn.o_proj.{hf}.weight": (f"layers.self_attn.{ours}", True, i)
          for i in range(cfg.num_hidden_layers) for hf, ours in _LORA_TENSORS.items()}


def _plan(names: dict[str, tuple[str, bool, int | None]], refs: dict[str, _TensorRef], where: pathlib.Path,
          cfg: NLDConfig) -> list[_Item]:
  """Matches the tensors a checkpoint holds against the ones `cfg` needs; names the first offender."""
  missing = [n for n in names if n not in refs]
  if missing:
    more = f" ({len(missing)} missing in total)" if len(missing) > 1 else ""
    raise ConversionError(f"{where} is missing tensor '{missing[0]}'{more}")
  unexpected = [n for n in refs if n not in names]
  if unexpected:
    raise ConversionError(f"unexpected tensor '{unexpected[0]}' in {refs[unexpected[0]].path} (not part of an NLD "
                          f"checkpoint with {cfg.num_hidden_layers} layers)")
  return [_Item(refs[hf], ours, transpose, layer) for hf, (ours, transpose, layer) in names.items()]


def _read_lora_config(lora_dir: pathlib.Path) -> tuple[int, float]:
  path = lora_dir / LORA_CONFIG_FILE
  if not path.exists():
    raise ConversionError(f"LoRA directory {lora_dir} has no {LORA_CONFIG_FILE}")
  raw = _load_json(path)
  for key in ("r", "lora_alpha", "target_modules"):
    if raw.get(key) is None:
      raise ConversionError(f"{path} is missing field '{key}'")
  targets = raw["target_modules"]
  targets = [targets] if isinstance(targets, str) else list(targets)
  if targets != ["o_proj"]:
    raise ConversionError(f"{path}: field 'target_modules' must be ['o_proj'] (NLD draft LoRA), got {targets}")
  # Our forward applies alpha/r; these PEFT variants would need a different update rule.
  for key in ("use_rslora", "use_dora"):
    if raw.get(key):
      raise ConversionError(f"{path}: field '{key}' is not supported")
  r, alpha = raw["r"], raw["lora_alpha"]
  if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(alpha, (int, float)) or alpha <= 0:
    raise ConversionError(f"{path}: fields 'r' and 'lora_alpha' must be positive, got r={r!r} lora_alpha={alpha!r}")
  return r, float(alpha)


def _check_shapes(cfg: NLDConfig, plan: list[_Item]) -> None:
  expected = param_shapes(cfg)
  mapped = {item.ours for item in plan}
  if mapped != set(expected):
    # Only reachable if the model gains a parameter the converter does not know: a bug here, not in the input.
    raise ConversionError(f"converter and model disagree on parameters: {sorted(set(expected) ^ mapped)[:3]}")
  for item in plan:
    want = tuple(expected[item.ours].shape)
    want = want[1:] if item.layer is not None else want  # one row of the stack
    want_hf = want[::-1] if item.transpose else want
    if item.ref.shape != want_hf:
      raise ConversionError(f"tensor '{item.ref.name}' in {item.ref.path} has shape {list(item.ref.shape)}, "
                            f"config implies {list(want_hf)}")


def convert_hf_checkpoint(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "bfloat16",
                          lora_dir: str | os.PathLike | None = None, progress: bool = True) -> NLDConfig:
  """Converts `hf_dir` (+ the PEFT draft LoRA in `lora_dir`) into our format in `out_dir`; returns the config.

  Raises ConversionError (a CheckpointError / ValueError) or ConfigError, naming the file, field or HF tensor.
  Memory: the converted params (one copy, in `dtype`) plus one source tensor at a time.
  """
  hf_dir, out_dir = pathlib.Path(hf_dir), pathlib.Path(out_dir)
  if dtype not in OUT_DTYPES:
    raise ConversionError(f"dtype must be one of {sorted(OUT_DTYPES)}, got {dtype!r}")
  if not hf_dir.is_dir():
    raise ConversionError(f"HF checkpoint directory {hf_dir} does not exist")
  if not (hf_dir / CONFIG_FILE).exists():
    raise ConversionError(f"{hf_dir} has no {CONFIG_FILE}")
  if out_dir.exists() and out_dir.resolve() == hf_dir.resolve():
    raise ConversionError(f"output directory {out_dir} is the HF directory; pick another one")
  # The HF config describes the base weights only; the adapter (if any) comes from lora_dir.
  cfg = NLDConfig.from_json_file(hf_dir / CONFIG_FILE).replace(lora_rank=0, lora_alpha=0.0)
  plan = _plan(_base_names(cfg), _index_tensors(hf_dir), hf_dir, cfg)
  if lora_dir is not None:
    lora_dir = pathlib.Path(lora_dir)
    if not lora_dir.is_dir():
      raise ConversionError(f"LoRA directory {lora_dir} does not exist")
    r, alpha = _read_lora_config(lora_dir)
    cfg = cfg.replace(lora_rank=r, lora_alpha=alpha)
    weights = lora_dir / LORA_WEIGHTS_FILE
    if not weights.exists():
      raise ConversionError(f"LoRA directory {lora_dir} has no {LORA_WEIGHTS_FILE}")
    plan += _plan(_lora_names(cfg), _read_header(weights), lora_dir, cfg)
  _check_shapes(cfg, plan)

  # One dtype for every tensor (the fp32 LoRA included): load_model restores all params in a single dtype.
  out_dtype = OUT_DTYPES[dtype]
  # each stacked tensor is allocated once and filled a layer at a time: still one copy of the params in memory
  flat = {name: np.empty(sds.shape, out_dtype) for name, sds in param_shapes(cfg).items()}
  for item in tqdm(plan, desc="converting", unit="tensor", disable=not progress):
    src = _read_tensor(item.ref)
    dst = flat[item.ours] if item.layer is None else flat[item.ours][item.layer]
    dst[...] = src.T if item.transpose else src  # the cast to out_dtype happens in this copy
    del src  # keep a single source tensor alive

  out_dir.mkdir(parents=True, exist_ok=True)
  # config.json is written last, so an interrupted conversion never leaves a directory load_model accepts.
  (out_dir / CONFIG_FILE).unlink(missing_ok=True)
  save_params(out_dir, flat)
  del flat
  for name in TOKENIZER_FILES:
    if (hf_dir / name).exists():
      shutil.copyfile(hf_dir / name, out_dir / name)
  cfg.save_json(out_dir / CONFIG_FILE)
  return cfg
