"""NLDConfig: presets and their sizes (docs/spec/nld.md §1.1), HF config.json round trips, and errors that name
the field."""

from __future__ import annotations

import copy
import json
import math

import pytest

from recguide_jax.model.checkpoint import param_shapes
from recguide_jax.model.config import PRESETS, ConfigError, NLDConfig

# The released NLD-8B instruct config.json as described in docs/spec/nld.md §1.2 (extra fields included on purpose).
_ROPE_8B = {"rope_type": "yarn", "type": "yarn", "rope_theta": 1.0e6, "factor": 16.0,
            "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
HF_8B = {
    "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
    "auto_map": {"AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
                 "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-05,
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "attention_dropout": 0.0,
    "sliding_window": None, "initializer_range": 0.02, "max_position_embeddings": 262144,
    "rope_parameters": dict(_ROPE_8B), "rope_scaling": dict(_ROPE_8B), "rope_theta": 1.0e6,
    "vocab_size": 131072, "bos_token_id": 1, "eos_token_id": 11, "pad_token_id": None, "mask_token_id": 100,
    "block_size": 32, "dlm_paradigm": "bidirectional", "dlm_type": "llada", "dlm_loss_weight": None,
    "ar_loss_weight": 1.0, "attn_implementation": "sdpa", "use_cache": False, "torch_dtype": "bfloat16",
    "transformers_version": "5.0.0",
}


def test_released_8b_config_is_the_preset():
  assert NLDConfig.from_hf_dict(HF_8B) == PRESETS["nld-8b"]


@pytest.mark.parametrize("name,billions,tensors,lora_millions", [
    ("nld-3b", 3.832, 237, 23.9), ("nld-8b", 8.490, 309, 35.7), ("nld-14b", 13.506, 363, 47.2)])
def test_preset_sizes(name, billions, tensors, lora_millions):
  cfg = PRESETS[name]
  assert round(cfg.num_params() / 1e9, 3) == billions
  assert cfg.head_dim == 128 and cfg.num_attention_heads * cfg.head_dim == 4096
  # The closed-form count must agree with the parameters the model really declares. Layers are identical, so a
  # one-layer model (abstract, no allocation) is checked and scaled: eval_shape of all layers takes seconds.
  one = param_shapes(cfg.replace(num_hidden_layers=1, lora_rank=128, lora_alpha=512.0))
  base = {n: math.prod(s.shape) for n, s in one.items() if ".lora_" not in n}
  per_layer = sum(v for n, v in base.items() if n.startswith("layers."))  # stacked [1, ...]: one layer's count
  assert per_layer * cfg.num_hidden_layers + sum(base.values()) - per_layer == cfg.num_params()
  assert len(base) - 9 + 9 * cfg.num_hidden_layers == tensors
  lora = sum(math.prod(s.shape) for n, s in one.items() if ".lora_" in n) * cfg.num_hidden_layers
  assert round(lora / 1e6, 1) == lora_millions


def test_8b_param_count_exact():
  assert PRESETS["nld-8b"].num_params() == 8_489_553_920


def test_14b_rope_theta():
  assert PRESETS["nld-14b"].rope_theta == 1.0e9 and PRESETS["nld-3b"].rope_theta == 1.0e6


_TINY = NLDConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, rope_theta=1.0e4, rope_factor=4.0,
                  original_max_position_embeddings=16, beta_fast=2.0, beta_slow=0.25, mscale_all_dim=0.5,
                  eos_token_ids=(11, 2), mask_token_id=100, block_size=8)


@pytest.mark.parametrize("cfg", [
    *PRESETS.values(), _TINY, _TINY.replace(lora_rank=4, lora_alpha=12.0),
    # YaRN-only fields are not written for plain RoPE, so this one keeps their defaults.
    NLDConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, head_dim=8, rope_type="default", rope_factor=1.0, rope_theta=500.0,
              original_max_position_embeddings=64, llama_4_scaling_beta=0.0),
    _TINY.replace(rope_attention_factor=0.8, rope_truncate=False, pad_token_id=0),
], ids=lambda c: f"L{c.num_hidden_layers}_H{c.hidden_size}_{c.rope_type}_r{c.lora_rank}_t{c.rope_truncate}")
def test_hf_dict_round_trip(cfg, tmp_path):
  assert NLDConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
  cfg.save_json(tmp_path / "config.json")
  assert NLDConfig.from_json_file(tmp_path / "config.json") == cfg


def _without(raw: dict, dotted: str) -> dict:
  raw = copy.deepcopy(raw)
  *parents, leaf = dotted.split(".")
  target = raw
  for p in parents:
    target = target[p]
  del target[leaf]
  return raw


@pytest.mark.parametrize("field", [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "eos_token_id", "mask_token_id",
    "rope_parameters.original_max_position_embeddings"])
def test_missing_field_is_named(field):
  raw = _without(HF_8B, field)
  with pytest.raises(ConfigError, match=f"'{field}'"):
    NLDConfig.from_hf_dict(raw)


def test_missing_rope_fields_are_named():
  raw = copy.deepcopy(HF_8B)
  for key in ("rope_parameters", "rope_scaling", "rope_theta"):
    raw.pop(key)
  with pytest.raises(ConfigError, match="'rope_parameters'"):
    NLDConfig.from_hf_dict(raw)
  raw = copy.deepcopy(HF_8B)
  for rope in (raw["rope_parameters"], raw["rope_scaling"]):
    rope.pop("rope_type")
    rope.pop("type")
  with pytest.raises(ConfigError, match="'rope_parameters.rope_type'"):
    NLDConfig.from_hf_dict(raw)
  raw = copy.deepcopy(HF_8B)
  raw.pop("rope_theta")
  raw["rope_parameters"].pop("rope_theta")
  with pytest.raises(ConfigError, match="'rope_parameters.rope_theta'"):
    NLDConfig.from_hf_dict(raw)


@pytest.mark.parametrize("change,field", [
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"head_dim": 127}, "head_dim"),
    ({"mask_token_id": -1}, "mask_token_id"),  # the class default of the remote code: must be set
    ({"mask_token_id": 131072}, "mask_token_id"),
    ({"eos_token_id": [11, 200000]}, "eos_token_id"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"rope_parameters": {**_ROPE_8B, "rope_type": "linear"}}, "rope_parameters.rope_type"),
    ({"draft_lora": {"r": 8, "lora_alpha": 0}}, "LoRA"),
])
def test_bad_values_are_named(change, field):
  with pytest.raises(ConfigError, match=f"{field}"):
    NLDConfig.from_hf_dict({**HF_8B, **change})


def test_yarn_factor_derived_only_when_absent():
  raw = copy.deepcopy(HF_8B)
  raw["rope_parameters"].pop("factor")
  assert NLDConfig.from_hf_dict(raw).rope_factor == 262144 / 16384
  raw["rope_parameters"]["factor"] = 4.0  # transformers v5 trusts an explicit factor even if it disagrees
  assert NLDConfig.from_hf_dict(raw).rope_factor == 4.0


def test_invalid_json_is_a_config_error(tmp_path):
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ConfigError, match="not valid JSON"):
    NLDConfig.from_json_file(tmp_path / "config.json")
