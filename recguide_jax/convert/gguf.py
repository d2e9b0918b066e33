"""llama.cpp GGUF (architecture `llama`) -> our checkpoint format (config.json + orbax params/ + tokenizer files).

The weights are dequantized to float with the `gguf` package (llama.cpp's own reader), whatever their GGML type.
llama.cpp's converter permutes the rows of `attn_q` / `attn_k` per head from HF's rotate-half layout to its
interleaved one (`LlamaModel.permute` in convert_hf_to_gguf.py); `_unpermute` undoes it, since our RoPE is HF's.
A GGUF without `output.weight` ties the head to the embedding (`tie_word_embeddings`).

The tokenizer is a `tokenizers` BPE built from the GGUF's vocabulary, merges and token types: byte-level as GPT-2
(pre-tokenizer and decoder), with llama.cpp's digit split for the `tokenizer.ggml.pre` kinds that have one;
control tokens become special added tokens. The chat template and bos/eos/pad/mask tokens go to
tokenizer_config.json.

NLD drafts with a mask token, which a plain Llama vocabulary lacks. Unless the GGUF names one
(`tokenizer.ggml.mask_token_id`) or the caller does, the mask is the highest-id control token that is none of
bos/eos/pad/unk and does not occur in the chat template: a reserved token a chat never produces (SmolLM2's
`<empty_output>`), so AR serving is unaffected. The model drafts with its own head (`DraftHead.NEXT_POSITION`:
a causal block whose logits at position i draft token i + 1), so its first draft token is its own greedy token
before any draft adapter is trained; an adapter teaches the mask tokens to look further ahead.
"""

from __future__ import annotations

import json
import os
import pathlib

import gguf
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from recguide_jax.model.checkpoint import CONFIG_FILE, param_shapes, save_params
from recguide_jax.model.config import DraftHead, NLDConfig
from recguide_jax.convert.hf import OUT_DTYPES, ConversionError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
ARCHITECTURE = "llama"
# llama.cpp's `tokenizer.ggml.pre` kinds whose pre-tokenizer is GPT-2's regex, and those that first split every
# digit on its own (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2 and _STARCODER/_SMOLLM/_REFACT).
_GPT2_PRE = ("gpt-2", "gpt2")
_DIGITS_GPT2_PRE = ("smollm", "starcoder", "refact")
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values

# GGUF name -> (our name, transpose). Per-layer entries are suffixes of `blk.N.` / our stacked `layers.`.
_LAYER_TENSORS = {
    "attn_norm.weight": ("input_layernorm.weight", False),
    "ffn_norm.weight": ("post_attention_layernorm.weight", False),
    "attn_q.weight": ("self_attn.q_proj.kernel", True),
    "attn_k.weight": ("self_attn.k_proj.kernel", True),
    "attn_v.weight": ("self_attn.v_proj.kernel", True),
    "attn_output.weight": ("self_attn.o_proj.kernel", True),
    "ffn_gate.weight": ("mlp.gate_proj.kernel", True),
    "ffn_up.weight": ("mlp.up_proj.kernel", True),
    "ffn_down.weight": ("mlp.down_proj.kernel", True),
}
_GLOBAL_TENSORS = {
    "token_embd.weight": ("embed_tokens.embedding", False),
    "output_norm.weight": ("norm.weight", False),
    "output.weight": ("diffusion_head.kernel", True),
}


def _field(reader: gguf.GGUFReader, key: str, default=None, *, required: bool = True):
  field = reader.get_field(key)
  if field is None:
    if required and default is None:
      raise ConversionError(f"GGUF is missing metadata key '{key}'")
    return default
  return field.contents()


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute`: per head, rows (pair, half) -> (half, pair), i.e. back to rotate-half."""
  out_dim = w.shape[0]
  return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _clean_float(value) -> float:
  # GGUF stores float32 (1e-5 reads back as 9.99999974e-06): the shortest decimal is what the HF config held
  return float(str(np.float32(value)))


def read_config(reader: gguf.GGUFReader, *, mask_token: str | None = None, block_size: int = 32,
                draft_head: DraftHead | str = DraftHead.NEXT_POSITION) -> NLDConfig:
  """The NLDConfig of a llama GGUF (see the module docstring for the mask token)."""
  arch = _field(reader, "general.architecture")
  if arch != ARCHITECTURE:
    raise ConversionError(f"GGUF metadata 'general.architecture' is {arch!r}; only {ARCHITECTURE!r} is supported")
  scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
  if scaling != "none":
    raise ConversionError(f"GGUF metadata '{arch}.rope.scaling.type' is {scaling!r}; only plain RoPE is supported")
  hidden = int(_field(reader, f"{arch}.embedding_length"))
  heads = int(_field(reader, f"{arch}.attention.head_count"))
  head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
  rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
  if rope_dim != head_dim:
    raise ConversionError(f"GGUF metadata '{arch}.rope.dimension_count' is {rope_dim}; partial RoPE (head_dim "
                          f"{head_dim}) is not supported")
  context = int(_field(reader, f"{arch}.context_length"))
  tokens = _field(reader, "tokenizer.ggml.tokens")
  token_types = _field(reader, "tokenizer.ggml.token_type")
  template = _field(reader, "tokenizer.chat_template", "")
  bos = int(_field(reader, "tokenizer.ggml.bos_token_id"))
  eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
  # a chat ends on its turn terminator: the GGUF's end-of-turn ids, and ChatML's `<|im_end|>` where it is used
  eos_ids = [eos] + [int(_field(reader, f"tokenizer.ggml.{k}_token_id", -1)) for k in ("eot", "eom")]
  if "<|im_end|>" in template and "<|im_end|>" in tokens:
    eos_ids.append(tokens.index("<|im_end|>"))
  eos_ids = tuple(dict.fromkeys(e for e in eos_ids if e >= 0))
  pad = _field(reader, "tokenizer.ggml.padding_token_id", required=False)
  unk = _field(reader, "tokenizer.ggml.unknown_token_id", required=False)
  mask = _mask_token_id(reader, tokens, token_types, template, mask_token,
                        reserved={bos, *eos_ids, *(int(t) for t in (pad, unk) if t is not None)})
  return NLDConfig(
      vocab_size=len(tokens), hidden_size=hidden, intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
      num_hidden_layers=int(_field(reader, f"{arch}.block_count")), num_attention_heads=heads,
      num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
      rms_norm_eps=_clean_float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
      max_position_embeddings=context, rope_type="default",
      rope_theta=_clean_float(_field(reader, f"{arch}.rope.freq_base", 10000.0)), rope_factor=1.0,
      original_max_position_embeddings=context, llama_4_scaling_beta=0.0, mask_token_id=mask, bos_token_id=bos,
      eos_token_ids=eos_ids, pad_token_id=None if pad is None else int(pad), block_size=block_size,
      tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors), draft_head=draft_head)


def _mask_token_id(reader, tokens, token_types, template: str, mask_token: str | None, reserved: set[int]) -> int:
  if mask_token is not None:
    if mask_token not in tokens:
      raise ConversionError(f"mask token {mask_token!r} is not in the GGUF vocabulary")
    return tokens.index(mask_token)
  named = _field(reader, "tokenizer.ggml.mask_token_id", required=False)
  if named is not None:
    return int(named)
  for i in range(len(tokens) - 1, -1, -1):
    if token_types[i] == _CONTROL and i not in reserved and tokens[i] not in template:
      return i
  raise ConversionError("the GGUF has no mask token ('tokenizer.ggml.mask_token_id') and no spare control token "
                        "to reserve as one; name one with mask_token")


def build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
  """A `tokenizers` byte-level BPE from the GGUF's vocabulary, merges and token types."""
  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ConversionError(f"GGUF metadata 'tokenizer.ggml.model' is {kind!r}; only 'gpt2' (byte-level BPE) is "
                          "supported")
  tokens = _field(reader, "tokenizer.ggml.tokens")
  token_types = _field(reader, "tokenizer.ggml.token_type")
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  pre = _field(reader, "tokenizer.ggml.pre", "gpt-2")
  prefix_space = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False, required=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=True)
  if pre in _GPT2_PRE:
    pre_tokenizer = byte_level
  elif pre in _DIGITS_GPT2_PRE:
    pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    raise ConversionError(f"GGUF metadata 'tokenizer.ggml.pre' is {pre!r}; supported: "
                          f"{sorted(_GPT2_PRE + _DIGITS_GPT2_PRE)}")
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                             byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizer
  tok.decoder = decoders.ByteLevel()
  # added tokens match before the BPE runs, so `<|im_start|>` in a rendered chat is one token, as in llama.cpp
  tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                          for i, t in enumerate(token_types) if t == _CONTROL])
  tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                  for i, t in enumerate(token_types) if t == _USER_DEFINED])
  if _field(reader, "tokenizer.ggml.add_bos_token", False, required=False):
    bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, tokens.index(bos))])
  return tok


def tokenizer_config(reader: gguf.GGUFReader, cfg: NLDConfig) -> dict:
  tokens = _field(reader, "tokenizer.ggml.tokens")
  out = {"bos_token": tokens[cfg.bos_token_id], "eos_token": tokens[cfg.eos_token_id],
         "mask_token": tokens[cfg.mask_token_id]}
  if cfg.pad_token_id is not None:
    out["pad_token"] = tokens[cfg.pad_token_id]
  template = _field(reader, "tokenizer.chat_template", "")
  if template:
    out["chat_template"] = template
  return out


def _tensor_plan(reader: gguf.GGUFReader, cfg: NLDConfig) -> list[tuple[gguf.ReaderTensor, str, bool, int | None]]:
  """(tensor, our name, transpose, layer row or None) for every tensor; names the first missing or unexpected one."""
  names = {g: (ours, transpose, None) for g, (ours, transpose) in _GLOBAL_TENSORS.items()
           if not (cfg.tie_word_embeddings and ours.startswith("diffusion_head"))}
  for i in range(cfg.num_hidden_layers):
    for g, (ours, transpose) in _LAYER_TENSORS.items():
      names[f"blk.{i}.{g}"] = (f"layers.{ours}", transpose, i)
  by_name = {t.name: t for t in reader.tensors}
  missing = [n for n in names if n not in by_name]
  if missing:
    raise ConversionError(f"GGUF is missing tensor '{missing[0]}' ({len(missing)} missing in total)")
  unexpected = [n for n in by_name if n not in names]
  if unexpected:
    raise ConversionError(f"unexpected tensor '{unexpected[0]}' in the GGUF (not part of a {cfg.num_hidden_layers}-"
                          "layer llama)")
  return [(by_name[g], ours, transpose, layer) for g, (ours, transpose, layer) in names.items()]


def _dequantized(t: gguf.ReaderTensor) -> np.ndarray:
  """The tensor as float32 in numpy order ([out, in] for a weight: GGUF's shape lists dims fastest first)."""
  try:
    w = gguf.quants.dequantize(t.data, t.tensor_type)
  except NotImplementedError as e:
    raise ConversionError(f"tensor '{t.name}' has GGML type {t.tensor_type.name}, which cannot be dequantized: "
                          f"{e}") from e
  return np.asarray(w, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def convert_gguf_checkpoint(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                            mask_token: str | None = None, lora_dir: str | os.PathLike | None = None,
                            draft_head: DraftHead | str = DraftHead.NEXT_POSITION, progress: bool = True) -> NLDConfig:
  """Converts the llama GGUF at `gguf_path` into our format in `out_dir`; returns the config. `lora_dir`: a PEFT
  draft adapter trained for this model (convert/peft.py: LoRA factors and the mask token's embedding row).

  Raises ConversionError (a CheckpointError / ValueError) or ConfigError naming the metadata key or tensor.
  Memory: the converted params (one copy, in `dtype`) plus one dequantized tensor at a time.
  """
  gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
  if dtype not in OUT_DTYPES:
    raise ConversionError(f"dtype must be one of {sorted(OUT_DTYPES)}, got {dtype!r}")
  if not gguf_path.is_file():
    raise ConversionError(f"GGUF file {gguf_path} does not exist")
  try:
    reader = gguf.GGUFReader(gguf_path)
  except (ValueError, OSError) as e:
    raise ConversionError(f"{gguf_path} is not a readable GGUF file: {e}") from e
  cfg = read_config(reader, mask_token=mask_token, draft_head=draft_head)
  tokenizer = build_tokenizer(reader)
  plan = _tensor_plan(reader, cfg)
  lora_flat, token_rows = {}, {}
  if lora_dir is not None:
    from recguide_jax.convert import peft
    cfg, lora_flat, token_rows = peft.read_adapter(lora_dir, cfg)
  expected = param_shapes(cfg)
  out_dtype = OUT_DTYPES[dtype]
  flat = {name: np.empty(sds.shape, out_dtype) for name, sds in expected.items()}
  for t, ours, transpose, layer in tqdm(plan, desc="dequantizing", unit="tensor", disable=not progress):
    want = tuple(expected[ours].shape[1:] if layer is not None else expected[ours].shape)
    want = want[::-1] if transpose else want
    have = tuple(int(d) for d in reversed(t.shape))
    if have != want:
      raise ConversionError(f"tensor '{t.name}' has shape {list(have)} ([out, in]), config implies {list(want)}")
    w = _dequantized(t)
    if t.name.endswith("attn_q.weight"):
      w = _unpermute(w, cfg.num_attention_heads)
    elif t.name.endswith("attn_k.weight"):
      w = _unpermute(w, cfg.num_key_value_heads)
    dst = flat[ours] if layer is None else flat[ours][layer]
    dst[...] = w.T if transpose else w
  for name, w in lora_flat.items():
    flat[name][...] = w
  for token, row in token_rows.items():  # the drafter's mask embedding (the mask token is never sampled)
    flat["embed_tokens.embedding"][token] = row

  out_dir.mkdir(parents=True, exist_ok=True)
  # config.json is written last, so an interrupted conversion never leaves a directory load_model accepts.
  (out_dir / CONFIG_FILE).unlink(missing_ok=True)
  save_params(out_dir, flat)
  del flat
  tokenizer.save(str(out_dir / TOKENIZER_FILE))
  (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config(reader, cfg), indent=2) + "\n")
  cfg.save_json(out_dir / CONFIG_FILE)
  return cfg
