"""Checkpoint conversion: Hugging Face NLD safetensors (+ optional PEFT draft LoRA) -> our orbax format."""

from recguide_jax.convert.hf import ConversionError, convert_hf_checkpoint

__all__ = ["ConversionError", "convert_hf_checkpoint"]
