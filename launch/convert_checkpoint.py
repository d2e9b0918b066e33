"""Converts a Hugging Face NLD checkpoint (and optionally its draft LoRA), or a llama.cpp GGUF of a Llama model,
into our checkpoint format.

  python launch/convert_checkpoint.py --hf_dir=/ckpt/Nemotron-Labs-Diffusion-8B --output_dir=/ckpt/nld-8b \\
      --lora_dir=/ckpt/Nemotron-Labs-Diffusion-8B/linear_spec_lora
  python launch/convert_checkpoint.py --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --output_dir=/ckpt/smollm2 --dtype=float32

Bad input prints one `error: ...` line naming the flag, file or tensor and exits with status 1.
"""

import os
import sys

# Runnable as a script from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

_HF_DIR = flags.DEFINE_string("hf_dir", None,
                              "HF checkpoint directory (config.json + model.safetensors[.index.json]).")
_GGUF = flags.DEFINE_string("gguf", None, "A llama.cpp GGUF file of a Llama model (any GGML type; dequantized).")
_MASK_TOKEN = flags.DEFINE_string("mask_token", None, "--gguf only: the vocabulary token NLD drafting uses as its mask "
                                  "(default: the GGUF's mask token, else its highest spare control token).")
_DRAFT_HEAD = flags.DEFINE_enum("draft_head", "next_position", ["next_position", "same_position"],
                                "--gguf only: how the model drafts a block. next_position: as its AR head was trained "
                                "(a causal block, the logits at position i draft token i + 1); same_position: as NLD "
                                "(a bidirectional block, each masked position drafts itself), for an adapter trained "
                                "that way.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Output directory (config.json + params/ + tokenizer files).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "dtype of the stored params.")
_LORA_DIR = flags.DEFINE_string("lora_dir", None, "Optional PEFT draft LoRA directory (adapter_config.json + "
                                "adapter_model.safetensors), e.g. <hf_dir>/linear_spec_lora, or with --gguf a draft "
                                "adapter trained for it (checkpoints/smollm2-135m-instruct-draft).")
flags.mark_flags_as_required(["output_dir"])


def _fail(message: str) -> None:
  print("error: " + " ".join(message.split()), file=sys.stderr)  # one line, whatever the exception held
  sys.exit(1)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every step of a save at INFO; --verbosity=0 brings it back
  hf_dir, lora_dir, gguf_path = _HF_DIR.value, _LORA_DIR.value, _GGUF.value
  if (hf_dir is None) == (gguf_path is None):
    _fail("pass exactly one of --hf_dir and --gguf")
  if gguf_path is not None:
    _convert_gguf(gguf_path)
    return
  if _MASK_TOKEN.value is not None:
    _fail("--mask_token applies to --gguf only (an NLD checkpoint names its mask token)")
  if flags.FLAGS["draft_head"].present:
    _fail("--draft_head applies to --gguf only (an NLD checkpoint drafts as it was trained: same_position)")
  if not os.path.isdir(hf_dir):
    _fail(f"--hf_dir: {hf_dir} is not a directory")
  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    _fail(f"--hf_dir: {hf_dir} has no config.json")
  if lora_dir is not None and not os.path.isdir(lora_dir):
    _fail(f"--lora_dir: {lora_dir} is not a directory")
  # Imported only now so that bad flags are reported at once, before jax loads.
  from recguide_jax.model.checkpoint import CheckpointError
  from recguide_jax.model.config import ConfigError
  from recguide_jax.convert import hf

  default_lora = os.path.join(hf_dir, hf.DEFAULT_LORA_SUBDIR)
  if lora_dir is None and os.path.isdir(default_lora):
    # Only converted on request: the base model serves without it, and the adapter changes config.json.
    print(f"note: {default_lora} exists; pass --lora_dir={default_lora} to include the draft LoRA", file=sys.stderr)
  try:
    cfg = hf.convert_hf_checkpoint(hf_dir, _OUTPUT_DIR.value, dtype=_DTYPE.value, lora_dir=lora_dir)
  except (ConfigError, CheckpointError, OSError) as e:
    _fail(str(e))
  lora = f", draft LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g}" if cfg.lora_rank else ""
  print(f"wrote {_OUTPUT_DIR.value}: {cfg.num_hidden_layers} layers, {cfg.num_params():,} base params, "
        f"{_DTYPE.value}{lora}")


def _convert_gguf(gguf_path: str) -> None:
  if _LORA_DIR.value is not None and not os.path.isdir(_LORA_DIR.value):
    _fail(f"--lora_dir: {_LORA_DIR.value} is not a directory")
  if not os.path.isfile(gguf_path):
    _fail(f"--gguf: {gguf_path} is not a file")
  from recguide_jax.model.checkpoint import CheckpointError
  from recguide_jax.model.config import ConfigError
  from recguide_jax.convert import gguf

  try:
    cfg = gguf.convert_gguf_checkpoint(gguf_path, _OUTPUT_DIR.value, dtype=_DTYPE.value, mask_token=_MASK_TOKEN.value,
                                       lora_dir=_LORA_DIR.value, draft_head=_DRAFT_HEAD.value)
  except (ConfigError, CheckpointError, OSError) as e:
    _fail(f"--gguf {gguf_path}: {e}")
  lora = (f", draft LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g} on {','.join(cfg.lora_target_modules)}"
          if cfg.lora_rank else "")
  print(f"wrote {_OUTPUT_DIR.value}: {cfg.num_hidden_layers} layers, {cfg.num_params():,} params, {_DTYPE.value}, "
        f"mask token id {cfg.mask_token_id}{lora}")


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
