"""A draft adapter for a plain Llama (a converted GGUF) as a PEFT adapter directory: `adapter_config.json` +
`adapter_model.safetensors`, named as PEFT names a `LlamaForCausalLM` adapter, so `--lora_dir` attaches it at
conversion as NLD's own `linear_spec_lora/` is attached to an NLD checkpoint.

- LoRA factors: `base_model.model.model.layers.N.{self_attn,mlp}.<proj>.lora_A.weight` [r, in] / `lora_B` [out, r]
  (ours: `layers.<parent>.<proj>.lora_a` [L, in, r] / `lora_b` [L, r, out]).
- The mask token's trained embedding: PEFT's trainable tokens (`trainable_token_indices` in the config,
  `base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta` [n, H], the rows' new values). Only the
  mask token's row may be replaced: any other row would change what the verifier computes.
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np

from recguide_jax.model.config import NLDConfig
from recguide_jax.convert import hf
from recguide_jax.convert.hf import ConversionError

LLAMA_LORA_PREFIX = "base_model.model.model.layers"
TRAINABLE_TOKENS = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
_ST_TAGS = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16"}


def write_safetensors(path: str | pathlib.Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
  """A safetensors file (8-byte header length, JSON header, raw little-endian data) of numpy arrays."""
  header, offset, blobs = {}, 0, []
  for name, a in tensors.items():
    a = np.ascontiguousarray(a)
    if a.dtype not in _ST_TAGS:
      raise ValueError(f"tensor {name}: dtype {a.dtype} cannot be written")
    blob = a.tobytes()
    header[name] = {"dtype": _ST_TAGS[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
    blobs.append(blob)
    offset += len(blob)
  if metadata:
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
  head = json.dumps(header, separators=(",", ":")).encode()
  head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(len(head).to_bytes(8, "little"))
    f.write(head)
    for blob in blobs:
      f.write(blob)


def write_adapter(directory: str | pathlib.Path, cfg: NLDConfig, flat: dict[str, np.ndarray],
                  mask_embed: np.ndarray | None = None, dtype: str = "bfloat16") -> pathlib.Path:
  """Writes the draft adapter of `cfg` (its LoRA factors `flat`, our stacked names, and optionally the mask token's
  embedding row) as a PEFT adapter directory; returns the safetensors path."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  out_dtype = hf.OUT_DTYPES[dtype]
  tensors = {}
  for name, (ours, transpose, layer) in hf.lora_names(cfg, LLAMA_LORA_PREFIX).items():
    w = np.asarray(flat[ours], np.float32)[layer]
    tensors[name] = (w.T if transpose else w).astype(out_dtype)
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": cfg.lora_rank,
            "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": list(cfg.lora_target_modules), "use_rslora": False, "use_dora": False,
            "inference_mode": True}
  if mask_embed is not None:
    tensors[TRAINABLE_TOKENS] = np.asarray(mask_embed, np.float32).reshape(1, -1).astype(out_dtype)
    config["trainable_token_indices"] = [cfg.mask_token_id]
  path = directory / hf.LORA_WEIGHTS_FILE
  write_safetensors(path, tensors, {"format": "pt"})
  (directory / hf.LORA_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
  return path


def read_adapter(directory: str | pathlib.Path, cfg: NLDConfig) -> tuple[NLDConfig, dict[str, np.ndarray],
                                                                         dict[int, np.ndarray]]:
  """(cfg with the adapter, {our stacked LoRA name: float32 array}, {token id: embedding row}) of a PEFT adapter
  directory for the Llama of `cfg`. Raises ConversionError naming the file, field or tensor."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise ConversionError(f"LoRA directory {directory} does not exist")
  from recguide_jax.model.config import LORA_TARGET_MODULES
  r, alpha, targets, raw = hf.read_lora_config(directory, LORA_TARGET_MODULES)
  cfg = cfg.replace(lora_rank=r, lora_alpha=alpha, lora_target_modules=targets)
  weights = directory / hf.LORA_WEIGHTS_FILE
  if not weights.exists():
    raise ConversionError(f"LoRA directory {directory} has no {hf.LORA_WEIGHTS_FILE}")
  refs = hf._read_header(weights)
  token_ids = _token_indices(directory, raw)
  if token_ids and TRAINABLE_TOKENS not in refs:
    raise ConversionError(f"{weights} is missing tensor '{TRAINABLE_TOKENS}' (the config names trainable tokens)")
  bad = [t for t in token_ids if t != cfg.mask_token_id]
  if bad:
    raise ConversionError(f"{directory / hf.LORA_CONFIG_FILE}: field 'trainable_token_indices' may name only the "
                          f"mask token ({cfg.mask_token_id}), got {bad[0]}: any other row would change the verifier")
  names = hf.lora_names(cfg, LLAMA_LORA_PREFIX)
  extra = {TRAINABLE_TOKENS: None} if token_ids else {}
  unexpected = [n for n in refs if n not in names and n not in extra]
  if unexpected:
    raise ConversionError(f"unexpected tensor '{unexpected[0]}' in {weights} (not part of a draft LoRA on "
                          f"{list(targets)})")
  missing = [n for n in names if n not in refs]
  if missing:
    raise ConversionError(f"{weights} is missing tensor '{missing[0]}' ({len(missing)} missing in total)")
  shapes = cfg.lora_shapes()
  flat = {}
  for name, (ours, transpose, layer) in names.items():
    module = ours.split(".")[-2]
    din, dout = shapes[module]
    want = (r, din) if name.endswith("lora_A.weight") else (dout, r)
    ref = refs[name]
    if ref.shape != want:
      raise ConversionError(f"tensor '{name}' in {weights} has shape {list(ref.shape)}, config implies {list(want)}")
    if ours not in flat:
      flat[ours] = np.zeros((cfg.num_hidden_layers,) + want[::-1], np.float32)
    flat[ours][layer] = np.asarray(hf._read_tensor(ref), np.float32).T
  rows = {}
  if token_ids:
    ref = refs[TRAINABLE_TOKENS]
    if ref.shape != (len(token_ids), cfg.hidden_size):
      raise ConversionError(f"tensor '{TRAINABLE_TOKENS}' in {weights} has shape {list(ref.shape)}, expected "
                            f"{[len(token_ids), cfg.hidden_size]}")
    values = np.asarray(hf._read_tensor(ref), np.float32)
    if not np.all(np.isfinite(values)):
      raise ConversionError(f"tensor '{TRAINABLE_TOKENS}' in {weights} holds non-finite values")
    rows = {t: values[i] for i, t in enumerate(token_ids)}
  return cfg, flat, rows


def _token_indices(directory: pathlib.Path, raw: dict) -> list[int]:
  value = raw.get("trainable_token_indices")
  if value is None:
    return []
  if isinstance(value, dict):  # PEFT also takes {module name: indices}
    value = [i for v in value.values() for i in v]
  if not isinstance(value, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in value):
    raise ConversionError(f"{directory / hf.LORA_CONFIG_FILE}: field 'trainable_token_indices' must be a list of "
                          f"token ids, got {value!r}")
  return value
