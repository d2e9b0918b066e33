"""Model configuration: a frozen `NLDConfig` read from (and written to) a Hugging Face `config.json`.

Field meanings follow the NLD checkpoint (Ministral3 backbone + untied `diffusion_head`); see
docs/spec/nld.md §1.2. A plain Llama (a converted GGUF, see convert/gguf.py) is the same backbone with
`rope_type="default"`, `llama_4_scaling_beta=0` and `tie_word_embeddings=True` (the embedding is the output head).
Every field a forward pass depends on is explicit here, so a checkpoint whose config misses one is rejected with
the field's name rather than silently falling back to a default.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, Mapping


# The projections a draft LoRA may adapt (PEFT module names), in the model's order.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The block sizes of speculative decoding (NLD's, and what RecGuide's tables are fitted for): the one definition
# the runtime, the engine and RecGuide import.
BLOCK_SIZES = (8, 16, 32)


class DraftHead(str, enum.Enum):
  """How the model drafts a block: what its draft was trained to read (config.json `draft_head`)."""
  # NLD's: a bidirectional block; the logits at a masked position draft that position's token; the draft adapter
  # is on for the whole block.
  SAME_POSITION = "same_position"
  # An AR model's (a converted Llama): a causal block; the logits at position i draft token i + 1, as its head was
  # trained to; the adapter is on for mask tokens only, so the seed's prediction is the verifier's own and greedy
  # drafting accepts at least two tokens per block before any adapter training.
  NEXT_POSITION = "next_position"


class ConfigError(ValueError):
  """A config.json is missing a field or holds an inconsistent value; the message names the field."""


@dataclasses.dataclass(frozen=True)
class NLDConfig:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  max_position_embeddings: int = 262144
  # RoPE ("yarn" as in NLD, or "default" = plain RoPE).
  rope_type: str = "yarn"
  rope_theta: float = 1.0e6
  rope_factor: float = 16.0
  original_max_position_embeddings: int = 16384
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 1.0
  # Explicit attention_factor if the config gives one (else derived from factor/mscale like HF does).
  rope_attention_factor: float | None = None
  rope_truncate: bool = True
  llama_4_scaling_beta: float = 0.1
  # Special tokens.
  mask_token_id: int = 100
  bos_token_id: int = 1
  eos_token_ids: tuple[int, ...] = (11,)
  pad_token_id: int | None = None
  block_size: int = 32
  # True: the output head is the embedding matrix (Llama checkpoints such as SmolLM2); False: NLD's own head.
  tie_word_embeddings: bool = False
  # Optional draft LoRA (PEFT linear_spec_lora): rank 0 means no adapter. NLD's is on o_proj; a draft adapter
  # trained here for a plain Llama may target any of LORA_TARGET_MODULES (PEFT's `target_modules`).
  lora_rank: int = 0
  lora_alpha: float = 0.0
  lora_target_modules: tuple[str, ...] = ("o_proj",)
  draft_head: DraftHead = DraftHead.SAME_POSITION

  def __post_init__(self):
    try:
      object.__setattr__(self, "draft_head", DraftHead(self.draft_head))
    except ValueError:
      raise ConfigError(f"config field 'draft_head' must be one of {[h.value for h in DraftHead]}, "
                        f"got {self.draft_head!r}") from None
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "original_max_position_embeddings",
                "block_size")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ConfigError(f"config field 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                        f"'num_attention_heads' ({self.num_attention_heads})")
    if self.head_dim % 2:
      raise ConfigError(f"config field 'head_dim' must be even for RoPE, got {self.head_dim}")
    if self.rope_type not in ("yarn", "default"):
      raise ConfigError(f"config field 'rope_parameters.rope_type' must be 'yarn' or 'default', got {self.rope_type!r}")
    if not (self.rms_norm_eps > 0):
      raise ConfigError(f"config field 'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
    if not (self.rope_theta > 0):
      raise ConfigError(f"config field 'rope_parameters.rope_theta' must be > 0, got {self.rope_theta}")
    if self.rope_type == "yarn" and not (self.rope_factor > 0):
      raise ConfigError(f"config field 'rope_parameters.factor' must be > 0, got {self.rope_factor}")
    if not 0 <= self.mask_token_id < self.vocab_size:
      raise ConfigError(f"config field 'mask_token_id' ({self.mask_token_id}) must be in [0, vocab_size)")
    for eos in self.eos_token_ids:
      if not 0 <= eos < self.vocab_size:
        raise ConfigError(f"config field 'eos_token_id' ({eos}) must be in [0, vocab_size)")
    if not self.eos_token_ids:
      raise ConfigError("config field 'eos_token_id' must name at least one token")
    if not isinstance(self.tie_word_embeddings, bool):
      raise ConfigError(f"config field 'tie_word_embeddings' must be a boolean, got {self.tie_word_embeddings!r}")
    if self.lora_rank < 0 or (self.lora_rank > 0 and self.lora_alpha <= 0):
      raise ConfigError(f"LoRA needs rank >= 0 and alpha > 0, got rank={self.lora_rank} alpha={self.lora_alpha}")
    unknown = [m for m in self.lora_target_modules if m not in LORA_TARGET_MODULES]
    if unknown or not self.lora_target_modules or len(set(self.lora_target_modules)) != len(self.lora_target_modules):
      raise ConfigError(f"config field 'draft_lora.target_modules' must name distinct modules of "
                        f"{list(LORA_TARGET_MODULES)}, got {list(self.lora_target_modules)}")

  # ---- derived quantities -----------------------------------------------------------------------------------
  @property
  def q_per_kv(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  @property
  def lora_scale(self) -> float:
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  @property
  def eos_token_id(self) -> int:
    return self.eos_token_ids[0]

  def num_params(self) -> int:
    h, i, nq, nkv, d = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                        self.num_key_value_heads, self.head_dim)
    per_layer = h * nq * d + 2 * h * nkv * d + nq * d * h + 3 * h * i + 2 * h
    heads = 1 if self.tie_word_embeddings else 2  # embedding (+ an untied head)
    return heads * self.vocab_size * h + self.num_hidden_layers * per_layer + h

  def lora_shapes(self) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection the draft LoRA adapts (empty without one)."""
    h, i, q, kv = (self.hidden_size, self.intermediate_size, self.num_attention_heads * self.head_dim,
                   self.num_key_value_heads * self.head_dim)
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}
    return {m: dims[m] for m in self.lora_target_modules} if self.lora_rank else {}

  def lora_num_params(self) -> int:
    return self.num_hidden_layers * self.lora_rank * sum(a + b for a, b in self.lora_shapes().values())

  def replace(self, **changes) -> "NLDConfig":
    return dataclasses.replace(self, **changes)

  # ---- HF config.json -----------------------------------------------------------------------------------------
  @classmethod
  def from_hf_dict(cls, raw: Mapping[str, Any]) -> "NLDConfig":
    """Reads an HF NLD / Ministral3 config dict. Missing required fields raise ConfigError naming the field."""

    def need(mapping: Mapping[str, Any], key: str, where: str = ""):
      if key not in mapping or mapping[key] is None:
        raise ConfigError(f"config.json is missing required field '{where}{key}'")
      return mapping[key]

    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    if rope is None:
      if "rope_theta" not in raw:
        raise ConfigError("config.json is missing required field 'rope_parameters' (or 'rope_theta')")
      rope = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
    rope = dict(rope)
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type is None:
      raise ConfigError("config.json is missing required field 'rope_parameters.rope_type'")
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
      raise ConfigError("config.json is missing required field 'rope_parameters.rope_theta'")
    max_pos = int(need(raw, "max_position_embeddings"))
    kwargs: dict[str, Any] = dict(rope_type=rope_type, rope_theta=float(theta))
    if rope_type == "yarn":
      orig = int(need(rope, "original_max_position_embeddings", "rope_parameters."))
      factor = rope.get("factor")
      # transformers v5 reads factor from the config and only derives it when absent.
      factor = float(factor) if factor is not None else max_pos / orig
      kwargs.update(
          rope_factor=factor, original_max_position_embeddings=orig,
          beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
          mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
          rope_attention_factor=(None if rope.get("attention_factor") is None else float(rope["attention_factor"])),
          rope_truncate=bool(rope.get("truncate", True)))
    else:
      kwargs.update(rope_factor=1.0, original_max_position_embeddings=int(
          rope.get("original_max_position_embeddings", max_pos)))
    beta4 = rope.get("llama_4_scaling_beta", raw.get("llama_4_scaling_beta"))
    kwargs["llama_4_scaling_beta"] = float(beta4) if beta4 is not None else 0.0

    num_heads = int(need(raw, "num_attention_heads"))
    hidden = int(need(raw, "hidden_size"))
    head_dim = raw.get("head_dim")
    if head_dim is None:
      raise ConfigError("config.json is missing required field 'head_dim' (NLD's head_dim is not hidden/heads)")
    eos = need(raw, "eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if raw.get("mask_token_id") is None or int(raw["mask_token_id"]) < 0:
      raise ConfigError("config.json is missing required field 'mask_token_id' (NLD needs a reserved mask id)")
    lora = raw.get("draft_lora") or {}
    return cls(
        vocab_size=int(need(raw, "vocab_size")), hidden_size=hidden,
        intermediate_size=int(need(raw, "intermediate_size")),
        num_hidden_layers=int(need(raw, "num_hidden_layers")), num_attention_heads=num_heads,
        num_key_value_heads=int(need(raw, "num_key_value_heads")), head_dim=int(head_dim),
        rms_norm_eps=float(need(raw, "rms_norm_eps")), max_position_embeddings=max_pos,
        mask_token_id=int(raw["mask_token_id"]), bos_token_id=int(raw.get("bos_token_id", 1)),
        eos_token_ids=eos_ids, pad_token_id=raw.get("pad_token_id"),
        block_size=int(raw.get("block_size", 32)), tie_word_embeddings=raw.get("tie_word_embeddings", False),
        lora_rank=int(lora.get("r", 0)), lora_alpha=float(lora.get("lora_alpha", 0.0)),
        lora_target_modules=_target_modules(lora.get("target_modules", ["o_proj"])),
        draft_head=raw.get("draft_head", DraftHead.SAME_POSITION.value), **kwargs)

  def to_hf_dict(self) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
    if self.rope_type == "yarn":
      rope.update(factor=self.rope_factor, original_max_position_embeddings=self.original_max_position_embeddings,
                  beta_fast=self.beta_fast, beta_slow=self.beta_slow, mscale=self.mscale,
                  mscale_all_dim=self.mscale_all_dim, truncate=self.rope_truncate)
      if self.rope_attention_factor is not None:
        rope["attention_factor"] = self.rope_attention_factor
    else:
      rope["original_max_position_embeddings"] = self.original_max_position_embeddings
    rope["llama_4_scaling_beta"] = self.llama_4_scaling_beta
    out = {
        "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
        "max_position_embeddings": self.max_position_embeddings, "rope_parameters": rope,
        "mask_token_id": self.mask_token_id, "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
        "pad_token_id": self.pad_token_id, "block_size": self.block_size,
        "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "draft_head": self.draft_head.value,
    }
    if self.lora_rank:
      out["draft_lora"] = {"r": self.lora_rank, "lora_alpha": self.lora_alpha,
                           "target_modules": list(self.lora_target_modules)}
    return out

  @classmethod
  def from_json_file(cls, path: str | os.PathLike) -> "NLDConfig":
    with open(path) as f:
      try:
        raw = json.load(f)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    return cls.from_hf_dict(raw)

  def save_json(self, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
      json.dump(self.to_hf_dict(), f, indent=2)


def _target_modules(value) -> tuple[str, ...]:
  """PEFT's `target_modules` (a name or a list) in the model's order."""
  names = [value] if isinstance(value, str) else list(value)
  if any(not isinstance(n, str) for n in names):
    raise ConfigError(f"config field 'draft_lora.target_modules' must be a list of module names, got {value!r}")
  known = [m for m in LORA_TARGET_MODULES if m in names]
  return tuple(known) + tuple(n for n in names if n not in LORA_TARGET_MODULES)


def _nld_preset(hidden: int, inter: int, layers: int, theta: float) -> NLDConfig:
  return NLDConfig(vocab_size=131072, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=theta)


PRESETS = {
    "nld-3b": _nld_preset(3072, 9216, 26, 1.0e6),
    "nld-8b": _nld_preset(4096, 14336, 34, 1.0e6),
    "nld-14b": _nld_preset(5120, 16384, 40, 1.0e9),
}

