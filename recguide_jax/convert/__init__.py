"""Checkpoint conversion into our orbax format: Hugging Face NLD safetensors (+ optional PEFT draft LoRA), or a
llama.cpp GGUF of a Llama model."""

from recguide_jax.convert.gguf import convert_gguf_checkpoint
from recguide_jax.convert.hf import ConversionError, convert_hf_checkpoint

__all__ = ["ConversionError", "convert_gguf_checkpoint", "convert_hf_checkpoint"]
