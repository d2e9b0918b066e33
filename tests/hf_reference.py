"""Test helpers (not a test module): tiny random HF Ministral3 models written out as NLD checkpoints, PEFT-style
draft LoRA adapters, and torch reference logits under custom attention masks and a per-token LoRA.

The reference is transformers' own `Ministral3ForCausalLM` (YaRN + Llama-4 query scale), fp32 on CPU with eager
attention, so a custom 4-D float mask is added to the scores exactly as given.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib

import numpy as np
import safetensors.torch
import torch
from transformers.models.ministral3.configuration_ministral3 import Ministral3Config
from transformers.models.ministral3.modeling_ministral3 import Ministral3ForCausalLM

TOKENIZER_STUBS = {"tokenizer.json": '{"stub": true}\n', "generation_config.json": '{"eos_token_id": [11]}\n'}


def nld_config_dict(*, vocab=128, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=24, theta=1.0e4,
                    factor=4.0, orig=16, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                    llama4_beta=0.1, max_pos=None, **rope_extra) -> dict:
  """An NLD-style config.json dict (docs/spec/nld.md §1.2) for a tiny model (max_pos defaults to factor * orig, as
  in NLD)."""
  max_pos = int(factor * orig) if max_pos is None else max_pos
  rope = {"rope_type": "yarn", "type": "yarn", "rope_theta": theta, "factor": factor,
          "original_max_position_embeddings": orig, "beta_fast": beta_fast, "beta_slow": beta_slow,
          "mscale": mscale, "mscale_all_dim": mscale_all_dim, "llama_4_scaling_beta": llama4_beta, **rope_extra}
  return {
      "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
      "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
      "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
      "rms_norm_eps": 1e-5, "max_position_embeddings": max_pos, "rope_parameters": rope, "rope_theta": theta,
      "bos_token_id": 1, "eos_token_id": 11, "pad_token_id": None, "mask_token_id": 100, "block_size": 8,
      "dlm_paradigm": "bidirectional", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
      "attention_dropout": 0.0, "sliding_window": None, "torch_dtype": "float32",
  }


def ministral3_config(nld: dict) -> Ministral3Config:
  keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "bos_token_id",
          "eos_token_id")
  rope = {k: v for k, v in nld["rope_parameters"].items() if k != "type"}
  cfg = Ministral3Config(**{k: nld[k] for k in keys}, rope_parameters=rope, pad_token_id=None,
                         tie_word_embeddings=False)
  cfg._attn_implementation = "eager"  # custom float masks are added to the scores as-is
  return cfg


def build_model(nld: dict, seed: int, std: float = 0.15) -> Ministral3ForCausalLM:
  """A random fp32 model. Weights are larger than HF's 0.02 init so attention is sharp (masks and RoPE matter) and
  norm weights are random so a swapped norm would show."""
  torch.manual_seed(seed)
  model = Ministral3ForCausalLM(ministral3_config(nld)).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.normal_(0.0, std)
  return model


def nld_state_dict(model: Ministral3ForCausalLM) -> dict[str, torch.Tensor]:
  """The HF NLD tensor names (docs/spec/nld.md §3.2): `model.` -> `encoder.`, `lm_head` -> `diffusion_head`."""
  out = {}
  for name, t in model.state_dict().items():
    if name.startswith("model."):
      name = "encoder." + name[len("model."):]
    elif name == "lm_head.weight":
      name = "diffusion_head.weight"
    out[name] = t.detach().contiguous()
  return out


def write_hf_dir(directory, nld: dict, tensors: dict[str, torch.Tensor], *, shards: int = 1,
                 dtype=torch.float32) -> pathlib.Path:
  """config.json + model.safetensors (shards == 1) or model.safetensors.index.json + shards, + tokenizer stubs."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(nld, indent=2))
  for name, text in TOKENIZER_STUBS.items():
    (directory / name).write_text(text)
  tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
  if shards == 1:
    safetensors.torch.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory
  names = list(tensors)
  per = math.ceil(len(names) / shards)
  weight_map = {}
  for s in range(shards):
    fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    chunk = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
    safetensors.torch.save_file(chunk, directory / fname, metadata={"format": "pt"})
    weight_map.update({n: fname for n in chunk})
  total = sum(t.numel() * t.element_size() for t in tensors.values())
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  return directory


def random_lora(nld: dict, r: int, seed: int, std: float = 0.1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
  """Per layer PEFT lora_A [r, heads*head_dim] and lora_B [hidden, r] (B non-zero, unlike a fresh adapter)."""
  g = torch.Generator().manual_seed(seed)
  d_in = nld["num_attention_heads"] * nld["head_dim"]
  a = [torch.randn(r, d_in, generator=g) * std for _ in range(nld["num_hidden_layers"])]
  b = [torch.randn(nld["hidden_size"], r, generator=g) * std for _ in range(nld["num_hidden_layers"])]
  return a, b


def lora_tensor_names(layer: int) -> tuple[str, str]:
  base = f"base_model.model.encoder.layers.{layer}.self_attn.o_proj"
  return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


def write_lora_dir(directory, a: list[torch.Tensor], b: list[torch.Tensor], r: int, alpha: float) -> pathlib.Path:
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  adapter_config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["o_proj"],
                    "lora_dropout": 0.0, "bias": "none", "inference_mode": True, "use_rslora": False,
                    "use_dora": False, "task_type": None}
  (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
  tensors = {}
  for i, (la, lb) in enumerate(zip(a, b)):
    name_a, name_b = lora_tensor_names(i)
    tensors[name_a], tensors[name_b] = la.float().contiguous(), lb.float().contiguous()
  safetensors.torch.save_file(tensors, directory / "adapter_model.safetensors")
  return directory


@contextlib.contextmanager
def lora_hooks(model: Ministral3ForCausalLM, a, b, scale: float, token_mask):
  """Adds scale * (x A^T) B^T to every o_proj output, only at positions where token_mask [T] is True."""
  on = torch.as_tensor(np.asarray(token_mask), dtype=torch.float32)[None, :, None]
  handles = []
  for layer, la, lb in zip(model.model.layers, a, b):
    def hook(module, args, out, la=la, lb=lb):
      return out + scale * ((args[0] @ la.T) @ lb.T) * on
    handles.append(layer.self_attn.o_proj.register_forward_hook(hook))
  try:
    yield
  finally:
    for h in handles:
      h.remove()


def draft_mask(total: int, block_start: int) -> torch.Tensor:
  """[1, 1, T, T] float mask (0 = attend, -inf = blocked): rows before `block_start` are causal, rows of the block
  [block_start, total) see the whole prefix and the whole block (the NLD draft / denoise pattern)."""
  allowed = torch.tril(torch.ones(total, total, dtype=torch.bool))
  allowed[block_start:, :] = True
  mask = torch.zeros(total, total)
  mask.masked_fill_(~allowed, float("-inf"))
  return mask[None, None]


def torch_logits(model: Ministral3ForCausalLM, tokens, mask: torch.Tensor | None = None) -> np.ndarray:
  """Logits [T, V] for one sequence at positions 0..T-1 (causal unless a 4-D float mask is given)."""
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None], attention_mask=mask,
                use_cache=False)
  return out.logits[0].float().numpy()
