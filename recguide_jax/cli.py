"""Flags and setup shared by the GSM8K-driven launch scripts (benchmark, bench_recguide, eval_model,
shadow_trace), so each script only defines what is its own."""

from __future__ import annotations

import os

from absl import flags, logging

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = os.path.join(REPO_ROOT, "..", "shared", "data", "gsm8k")


def define_model_and_data_flags(split: str = "test", num_prompts: int = 32, max_tokens: int = 128) -> None:
  flags.DEFINE_string("checkpoint", None, "Checkpoint dir (default: the bundled model).")
  flags.DEFINE_enum("attention", "auto", ["auto", "reference", "pallas"], "Attention implementation.")
  define_dtype_flag()
  flags.DEFINE_string("data", os.path.join(GSM8K_DIR, f"{split}.jsonl"), f"GSM8K {split} jsonl (prompts).")
  flags.DEFINE_integer("num_prompts", num_prompts, "Prompts from the start of the data file.")
  flags.DEFINE_integer("max_tokens", max_tokens, "New tokens per request (greedy, stops at EOS).")


def define_dtype_flag() -> None:
  """--dtype of every script that builds a model (serve.py has the same flag)."""
  flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16", "float16"],
                    "Weights, activations and KV cache dtype; auto: the checkpoint's.")


def quiet_logging() -> None:
  """orbax logs every step of a checkpoint read at INFO; keep it quiet unless --verbosity was given."""
  if flags.FLAGS["verbosity"].using_default_value:
    logging.set_verbosity(logging.WARNING)


def weights_flag(name: str, count: int) -> tuple[float, ...]:
  """A list flag of `count` non-negative weights, not all zero; exits with a message naming the flag."""
  import sys
  try:
    weights = tuple(float(p) for p in flags.FLAGS[name].value)
  except ValueError:
    sys.exit(f"error: --{name} must be numbers, got {flags.FLAGS[name].value}")
  if len(weights) != count or any(p < 0 for p in weights) or not sum(weights):
    sys.exit(f"error: --{name} needs {count} non-negative weights, not all zero, got {list(weights)}")
  return weights


def block_mix_flags() -> tuple[tuple[int, ...], tuple[float, ...]]:
  """--block_sizes and --block_probs of the training scripts, checked against --seq_len."""
  import sys
  f = flags.FLAGS
  try:
    sizes = tuple(int(b) for b in f.block_sizes)
  except ValueError:
    sys.exit(f"error: --block_sizes must be integers, got {f.block_sizes}")
  if not sizes or min(sizes) < 1:
    sys.exit("error: --block_sizes must be positive integers")
  probs = weights_flag("block_probs", len(sizes))
  if f.seq_len % max(sizes):
    sys.exit("error: --seq_len must be a multiple of every --block_sizes entry")
  return sizes, probs
