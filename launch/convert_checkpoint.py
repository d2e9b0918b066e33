"""Converts a Hugging Face NLD checkpoint (and optionally its draft LoRA) into our checkpoint format.

  python launch/convert_checkpoint.py --hf_dir=/ckpt/Nemotron-Labs-Diffusion-8B --output_dir=/ckpt/nld-8b \
      --lora_dir=/ckpt/Nemotron-Labs-Diffusion-8B/linear_spec_lora

Bad input prints one `error: ...` line naming the flag, file or tensor and exits with status 1.
"""

import os
import sys

# Runnable as a script from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

_HF_DIR = flags.DEFINE_string("hf_dir", None,
                              "HF checkpoint directory (config.json + model.safetensors[.index.json]).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Output directory (config.json + params/ + tokenizer files).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "dtype of the stored params.")
_LORA_DIR = flags.DEFINE_string("lora_dir", None, "Optional PEFT draft LoRA directory (adapter_config.json + "
                                "adapter_model.safetensors), e.g. <hf_dir>/linear_spec_lora.")
flags.mark_flags_as_required(["hf_dir", "output_dir"])


def _fail(message: str) -> None:
  print("error: " + " ".join(message.split()), file=sys.stderr)  # one line, whatever the exception held
  sys.exit(1)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every step of a save at INFO; --verbosity=0 brings it back
  hf_dir, lora_dir = _HF_DIR.value, _LORA_DIR.value
  if not os.path.isdir(hf_dir):
    _fail(f"--hf_dir: {hf_dir} is not a directory")
  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    _fail(f"--hf_dir: {hf_dir} has no config.json")
  if lora_dir is not None and not os.path.isdir(lora_dir):
    _fail(f"--lora_dir: {lora_dir} is not a directory")
  # Imported only now so that bad flags are reported at once, before jax loads.
  from recguide_jax.checkpoint import CheckpointError
  from recguide_jax.config import ConfigError
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


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)  # absl's app.run; --help / -h exit 0
