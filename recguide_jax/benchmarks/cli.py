"""The flag vocabulary of the launch scripts, so one name means one thing in every script:

  --model           the model (checkpoint directory; default: the bundled one), vLLM's name
  --max_num_seqs    the engine's most requests decoded together (vLLM's name)
  --base_url        a running server's URL
  --concurrency     requests in flight; a comma-separated list of levels where a script sweeps
  --output_dir      where JSON / markdown reports go; default runs/<script>, `--output_dir=docs` publishes
  --dtype           weights / activations / KV cache dtype (auto: the checkpoint's)
  --max_model_len   longest prompt + output of the engine, in tokens
  --num_prompts     prompts from the start of the data file
  --max_tokens      new tokens per request
  --data            one GSM8K split's jsonl (default: <--gsm8k_dir>/<split>.jsonl)
  --gsm8k_dir       the folder of GSM8K's train.jsonl / test.jsonl (default: $RECGUIDE_GSM8K_DIR, else
                    ../shared/data/gsm8k beside the repository)

One name per concept, no aliases; `run` reads vLLM's dashed spellings (`--max-num-seqs`) as the underscored ones.
Errors in flag values exit with a one-line message that names the flag, not a traceback."""

from __future__ import annotations

import os
import re
import sys

from absl import app, flags, logging

from recguide_jax.benchmarks import gsm8k

REPO_ROOT = str(gsm8k.REPO_ROOT)
GSM8K_DIR = gsm8k.default_gsm8k_dir()  # read once, when the flags are defined

DTYPES = ["auto", "float32", "bfloat16", "float16"]
_DATA_SPLIT = {"data": "test"}  # the GSM8K split each data flag defaults to


HELP_ARGS = ("-h", "-help", "--help", "--helpshort")


def underscored(argv: list[str]) -> list[str]:
  """`--max-num-seqs[=4]` -> `--max_num_seqs[=4]`: vLLM spells flags with dashes, absl only knows underscores, so
  both spellings work; vLLM's negated booleans (`--no-enable-prefix-caching`) become absl's (`--noenable_...`).
  Values and everything after a bare `--` are left as they are."""
  out = list(argv[:1])
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      return out + list(argv[i:])
    if arg.startswith("--no-") and "=" not in arg:
      arg = "--no" + arg[len("--no-"):]
    m = re.fullmatch(r"(--?)([A-Za-z][\w-]*)(=.*)?", arg, flags=re.S)
    out.append(m.group(1) + m.group(2).replace("-", "_") + (m.group(3) or "") if m else arg)
  return out


def adopt_used_flags() -> None:
  """Lists in the script's `--help` the flags the modules it uses defined (absl shows only the main module's):
  every non-absl module's flags become key flags of the script."""
  main = sys.argv[0]
  for module in list(flags.FLAGS.flags_by_module_dict()):
    if module != main and not module.startswith("absl."):
      for flag in flags.FLAGS.get_key_flags_for_module(module):
        flags.FLAGS.register_key_flag_for_module(main, flag)


def run(main, flags_parser=None) -> None:
  """absl's `app.run`, for every launch script: dashed flag names are read as underscored ones, and `-h` / `--help`
  / `--helpshort` (and `--helpfull`) print the usage, with the flags of the modules the script uses, and exit 0,
  as vLLM's commands do (absl exits 1, and `-h` is not an absl flag)."""
  parse_rest = flags_parser or app.parse_flags_with_usage

  def parse(argv):
    argv = underscored(argv)
    args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if any(a in HELP_ARGS for a in args):
      adopt_used_flags()
      app.usage(shorthelp=True, writeto_stdout=True, exitcode=0)
    if "--helpfull" in args:
      app.usage(writeto_stdout=True, exitcode=0)
    return parse_rest(argv)

  app.run(main, flags_parser=parse)


def define_model_flag(help_text: str = "Checkpoint dir (default: the bundled model).") -> None:
  """--model, vLLM's name for the model to load: our checkpoint directory."""
  flags.DEFINE_string("model", None, help_text)


def define_dtype_flag(default: str = "auto", choices: list[str] | None = None) -> None:
  """--dtype of every script that builds a model (serve.py has the same flag)."""
  flags.DEFINE_enum("dtype", default, choices or DTYPES,
                    "Weights, activations and KV cache dtype; auto: the checkpoint's.")


def define_gsm8k_dir_flag() -> None:
  flags.DEFINE_string("gsm8k_dir", GSM8K_DIR, f"Folder holding GSM8K's train.jsonl and test.jsonl (default: "
                      f"${gsm8k.GSM8K_ENV}, else ../shared/data/gsm8k beside the repository).")


def define_data_flag(split: str, name: str = "data", what: str = "prompts") -> None:
  """--data: one GSM8K split's jsonl, by default <--gsm8k_dir>/<split>.jsonl (also defines --gsm8k_dir)."""
  if "gsm8k_dir" not in flags.FLAGS:
    define_gsm8k_dir_flag()
  flags.DEFINE_string(name, None, f"GSM8K {split} jsonl ({what}); default: <--gsm8k_dir>/{split}.jsonl.")
  _DATA_SPLIT[name] = split


def define_model_flags(max_model_len: int = 1024) -> None:
  """--model, --attention, --dtype and --max_model_len of a script that builds an LLM."""
  define_model_flag()
  flags.DEFINE_enum("attention", "auto", ["auto", "reference", "pallas"], "Attention implementation.")
  define_dtype_flag()
  flags.DEFINE_integer("max_model_len", max_model_len, "Longest prompt + output of the engine, in tokens.")


def define_model_and_data_flags(split: str = "test", num_prompts: int = 32, max_tokens: int = 128,
                                max_model_len: int = 1024) -> None:
  """The model flags, --data / --gsm8k_dir for GSM8K's `split`, --num_prompts and --max_tokens."""
  define_model_flags(max_model_len)
  define_data_flag(split)
  flags.DEFINE_integer("num_prompts", num_prompts, "Prompts from the start of the data file.")
  flags.DEFINE_integer("max_tokens", max_tokens, "New tokens per request (greedy, stops at EOS).")


def define_output_flags(script: str) -> None:
  """--output_dir (default runs/<script>)."""
  flags.DEFINE_string("output_dir", os.path.join(REPO_ROOT, "runs", script),
                      "Where the reports go (default: runs/<script>; `docs` writes the published copies in docs/).")


def output_dir() -> str:
  """--output_dir, with `docs` meaning the repository's docs/ whatever the working directory."""
  out = flags.FLAGS.output_dir
  if not out:
    sys.exit("error: --output_dir must not be empty")
  return os.path.join(REPO_ROOT, "docs") if os.path.normpath(out) == "docs" else out


def report_path(file_name: str) -> str:
  """--output_dir/file_name; creates the folder."""
  path = os.path.join(output_dir(), file_name)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return path


def data_path(name: str = "data") -> str:
  """The GSM8K jsonl a data flag names (default <--gsm8k_dir>/<split>.jsonl); exits naming the flags when the file
  is missing, before any model is loaded."""
  f = flags.FLAGS
  path = f[name].value or gsm8k.gsm8k_file(_DATA_SPLIT.get(name, "test"), f.gsm8k_dir if "gsm8k_dir" in f else None)
  if not os.path.isfile(path):
    how = (f"--{name} was given" if f[name].value else
           f"from --gsm8k_dir={f.gsm8k_dir if 'gsm8k_dir' in f else GSM8K_DIR}")
    sys.exit(f"error: --{name}: GSM8K file {path} not found ({how}). Pass --{name}=FILE.jsonl, or "
             f"--gsm8k_dir=DIR (or ${gsm8k.GSM8K_ENV}=DIR) holding {_DATA_SPLIT.get(name, 'test')}.jsonl; "
             "GSM8K is not part of the repository.")
  return path


def int_list(name: str, minimum: int = 1) -> list[int]:
  """A list flag of integers >= minimum; exits with a message naming the flag otherwise."""
  raw = flags.FLAGS[name].value
  try:
    values = [int(v) for v in raw]
  except (TypeError, ValueError):
    sys.exit(f"error: --{name} must be comma-separated integers, got {raw}")
  if not values or min(values) < minimum:
    sys.exit(f"error: --{name} needs integers >= {minimum}, got {values}")
  return values


def quiet_logging() -> None:
  """orbax logs every step of a checkpoint read at INFO; keep it quiet unless --verbosity was given."""
  if flags.FLAGS["verbosity"].using_default_value:
    logging.set_verbosity(logging.WARNING)


def weights_flag(name: str, count: int) -> tuple[float, ...]:
  """A list flag of `count` non-negative weights, not all zero; exits with a message naming the flag."""
  try:
    weights = tuple(float(p) for p in flags.FLAGS[name].value)
  except ValueError:
    sys.exit(f"error: --{name} must be numbers, got {flags.FLAGS[name].value}")
  if len(weights) != count or any(p < 0 for p in weights) or not sum(weights):
    sys.exit(f"error: --{name} needs {count} non-negative weights, not all zero, got {list(weights)}")
  return weights


def block_mix_flags() -> tuple[tuple[int, ...], tuple[float, ...]]:
  """--block_sizes and --block_probs of the training scripts, checked against --seq_len."""
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
